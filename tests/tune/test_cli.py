"""`kiln compile --tune` as a user runs it: progress while tuning, Ctrl-C, failures with reasons."""
from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

from kiln.pipeline import CompileOptions, compile_artifact
from kiln.profile.local import default_store
from kiln.tune import format_tuning

REPO = Path(__file__).resolve().parents[2]


def kiln_process(tmp_path: Path, *args: str) -> subprocess.Popen:
    """`kiln` in its own process group, as a shell runs a foreground job (Ctrl-C reaches the
    whole group), with stderr not a terminal: plain progress lines."""
    env = {**os.environ, "KILN_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "kiln.cli", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def test_ctrl_c_while_tuning_ends_with_one_line_status_130_and_nothing_half_written(
        small_model, tmp_path):
    out, db = tmp_path / "out" / "ffn.kiln", tmp_path / "profiles.sqlite"
    out.parent.mkdir()
    proc = kiln_process(tmp_path, "compile", str(small_model), "-o", str(out), "--tune", "quick",
                        "--tune-budget", "300", "--profile-db", str(db))
    seen = []
    try:
        for line in proc.stderr:
            seen.append(line)
            if "measuring kernel 1/" in line:
                break
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        stdout, rest = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    stderr = "".join(seen) + rest
    assert any("measuring kernel 1/" in line for line in seen), stderr
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert stderr.splitlines()[-1].startswith("kiln: interrupted")
    assert [line for line in stderr.splitlines() if not line.startswith("kiln: ")] == []
    assert list(out.parent.iterdir()) == []  # no artifact, no temporary file
    with sqlite3.connect(db) as conn:  # the profile database is whole, with what was measured
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        assert conn.execute("SELECT COUNT(*) FROM profile_entries").fetchone()[0] >= 1


def test_progress_counts_every_measured_kernel(small_model, tmp_path):
    calls = []
    report = compile_artifact(small_model, tmp_path / "ffn.kiln",
                              CompileOptions(tune="quick", tune_budget=120),
                              default_store(tmp_path / "profiles.sqlite"),
                              on_progress=lambda *a: calls.append(a))
    tuning = [c for c in calls if c[0] == "tune"]
    measured = report["tuning"]["measured"] + report["tuning"]["failed"]
    assert measured > 0
    assert [c[1] for c in tuning] == list(range(1, measured + 1))
    assert all(done <= total for _, done, total, _ in tuning)
    assert tuning[-1][2] == measured  # the estimated total ends exact
    assert all(isinstance(c[3], str) and c[3] for c in tuning)
    lookups = [c for c in calls if c[0] == "plan"]
    assert lookups and [c[1] for c in lookups] == list(range(1, len(lookups) + 1))


def test_plain_progress_lines_of_the_cli(small_model, tmp_path):
    proc = kiln_process(tmp_path, "compile", str(small_model), "-o", str(tmp_path / "a.kiln"),
                        "--tune", "quick", "--profile-db", str(tmp_path / "p.sqlite"))
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    assert "kiln: tune: measuring kernel 1/" in stderr
    assert "kiln: build" in stderr and "tuning (quick" in stdout


def test_failed_measurements_are_reported_with_their_reasons_never_as_zero_ms():
    tuning = {"mode": "quick", "threads": 2, "measured": 1, "reused": 0, "failed": 2,
              "seconds": 1.0, "budget_s": 60.0, "schedules": {}, "skipped": {}, "groups": [
                  {"name": "fused_matmul_relu", "blocks": 1, "best": {}, "best_ms": None,
                   "default_ms": None,
                   "note": "the default kernel could not be measured: compiling k0 failed",
                   "failures": [{"schedule": {}, "reason": "compiling k0 failed"},
                                {"schedule": {"gemm_mc": 64}, "reason": "the measuring process "
                                                                       "stopped: exit code -11"}]},
                  {"name": "fused_add", "blocks": 2, "best": {"vector": 8}, "best_ms": 0.00042,
                   "default_ms": 0.0009, "note": "", "failures": []}]}
    text = format_tuning(tuning)
    assert "0.000 ms" not in text
    assert "not tuned: the default kernel could not be measured: compiling k0 failed" in text
    assert 'failed {"gemm_mc": 64}: the measuring process stopped: exit code -11' in text
    assert re.search(r"900 ns -> +420 ns", text)


def test_a_terminal_gets_a_progress_bar(small_model, tmp_path):
    """stderr a terminal (a pseudo-terminal here): rich draws the bar, then clears it."""
    leader, follower = os.openpty()
    env = {**os.environ, "KILN_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(REPO),
           "COLUMNS": "160"}
    proc = subprocess.Popen([sys.executable, "-m", "kiln.cli", "compile", str(small_model), "-o",
                             str(tmp_path / "a.kiln"), "--tune", "quick", "--profile-db",
                             str(tmp_path / "p.sqlite")], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=follower, text=True)
    os.close(follower)
    shown = b""
    while True:
        try:
            chunk = os.read(leader, 1 << 16)
        except OSError:  # the terminal closed: the process is gone
            break
        if not chunk:
            break
        shown += chunk
    os.close(leader)
    stdout = proc.stdout.read()
    assert proc.wait(timeout=300) == 0, shown.decode(errors="replace")
    screen = shown.decode(errors="replace")
    assert "tune: measuring kernels" in screen and "━" in screen  # rich's bar
    assert "kiln: tune: measuring kernel 1/" not in screen  # not the plain lines
    assert "Traceback" not in screen and "tuning (quick" in stdout
