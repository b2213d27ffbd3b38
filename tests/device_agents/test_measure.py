"""Measuring artifacts on the local machine, over ssh and on the stand-in phone; refusals."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import kiln.codegen
from device_agents.backends.local import LocalBackend
from device_agents.measure import (
    RUNNER_NAME,
    BundleHashError,
    MeasurementError,
    build_bundle,
    measure,
    parse_runner_output,
)
from kiln.cli import main as kiln_main
from kiln.runtime.artifact import open_artifact
from tests.device_agents.test_backends import adb_backend, run, ssh_backend

ZOO = Path(__file__).resolve().parents[1] / "fixtures" / "zoo"


class CountingBackend(LocalBackend):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pushed: list[str] = []
        self.runs: list[list[str]] = []

    async def push(self, local_path, remote_path, mode=0o644):
        self.pushed.append(Path(remote_path).name)
        await super().push(local_path, remote_path, mode)

    async def run(self, argv, timeout):
        self.runs.append(argv)
        return await super().run(argv, timeout)


def check_measurement(m, artifact, repeats: int) -> None:
    assert [(k.symbol, k.block) for k in m.kernels] == [
        (k["symbol"], k["block"]) for k in artifact.manifest["kernels"]]
    assert all(len(k.samples_s) == repeats for k in m.kernels)
    assert all(0 < s < 60 for k in m.kernels for s in k.samples_s)
    # runner.c prints every run's time (runs <= 100): runs x repeats per-run samples per kernel
    assert all(len(k.run_samples_s) == m.runs * repeats for k in m.kernels)
    assert all(0 < s < 60 for k in m.kernels for s in k.run_samples_s)
    assert len(m.totals) == repeats
    assert m.artifact_hash == artifact.manifest["content_hash"]
    assert m.runner_sha256 == artifact.manifest["files"]["bin/kiln-runner"]
    # the runner's own peak resident memory: the plan's tensors plus its code, not gigabytes
    assert artifact.manifest["peak_memory_bytes"] < m.peak_rss_bytes < 1 << 30


def test_measure_locally_and_reuse_the_bundle(host_artifact, tmp_path):
    backend = CountingBackend(tmp_path / "device")

    async def scenario():
        facts = await backend.facts()
        first = await measure(backend, facts, host_artifact, runs=5, warmup=1, repeats=2,
                              cache_dir=tmp_path / "cache")
        pushed = list(backend.pushed)
        second = await measure(backend, facts, host_artifact, runs=3, repeats=1, threads=1,
                               cache_dir=tmp_path / "cache")
        return first, second, pushed

    first, second, pushed = run(scenario(), backend)
    check_measurement(first, host_artifact, 2)
    check_measurement(second, host_artifact, 1)
    assert (first.runs, first.warmup, second.threads) == (5, 1, 1)
    assert not first.emulated
    assert sorted(pushed) == ["input_0.npy", RUNNER_NAME, "weights.bin"]
    assert len(backend.pushed) == 3  # the second measurement pushed nothing
    assert first.bundle_id == second.bundle_id == build_bundle(host_artifact,
                                                               tmp_path / "cache").id


def test_measure_a_compiled_zoo_model(tmp_path, capsys):
    """What `kiln compile MODEL -o model.kiln` writes (the real code generator), measured here."""
    if not hasattr(kiln.codegen, "generate"):
        pytest.skip("the code generator has not landed")
    path = tmp_path / "resnet50.kiln"
    assert kiln_main(["compile", str(ZOO / "resnet50.onnx"), "-o", str(path)]) == 0, (
        capsys.readouterr().err)
    artifact = open_artifact(path, tmp_path / "extracted")
    backend = LocalBackend(tmp_path / "device")

    async def scenario():
        facts = await backend.facts()
        return await measure(backend, facts, artifact, runs=3, repeats=2,
                             cache_dir=tmp_path / "cache")

    check_measurement(run(scenario(), backend), artifact, 2)


def test_measure_over_ssh(sshd, host_artifact, tmp_path):
    backend = ssh_backend(sshd, tmp_path / "remote work")

    async def scenario():
        facts = await backend.facts()
        return await measure(backend, facts, host_artifact, runs=5, repeats=2,
                             cache_dir=tmp_path / "cache")

    check_measurement(run(scenario(), backend), host_artifact, 2)
    bundles = list((tmp_path / "remote work" / "bundles").iterdir())
    assert len(bundles) == 1 and (bundles[0] / RUNNER_NAME).stat().st_mode & 0o111


def test_measure_aarch64_on_the_phone(phone, arm_artifact, host_artifact, tmp_path):
    backend = adb_backend(phone, tmp_path)

    async def scenario():
        facts = await backend.facts()
        measured = await measure(backend, facts, arm_artifact, runs=3, repeats=2,
                                 cache_dir=tmp_path / "cache")
        with pytest.raises(MeasurementError, match="built for x86_64 but phone-test is aarch64"):
            await measure(backend, facts, host_artifact, runs=3, cache_dir=tmp_path / "cache")
        return measured

    measured = run(scenario(), backend)
    check_measurement(measured, arm_artifact, 2)
    assert measured.emulated
    runner_commands = [c for c in phone.commands if f"{RUNNER_NAME}' -n 3" in c
                       or f"{RUNNER_NAME} -n 3" in c]
    assert len(runner_commands) == 2


def test_aarch64_artifact_is_refused_on_this_machine(arm_artifact, tmp_path):
    backend = LocalBackend(tmp_path / "device")

    async def scenario():
        facts = await backend.facts()
        await measure(backend, facts, arm_artifact, runs=1, cache_dir=tmp_path / "cache")

    with pytest.raises(MeasurementError, match=r"aarch64 devices \(phones over adb\)"):
        run(scenario(), backend)


def test_missing_isa_is_refused(host_artifact, tmp_path):
    if not host_artifact.isa:
        pytest.skip("this machine's artifacts use no optional ISA feature")
    backend = LocalBackend(tmp_path / "device")

    async def scenario():
        facts = (await backend.facts()).model_copy(update={"isa": ("sse2",)})
        await measure(backend, facts, host_artifact, runs=1, cache_dir=tmp_path / "cache")

    with pytest.raises(MeasurementError, match=f"uses {host_artifact.isa[0]}"):
        run(scenario(), backend)


class TamperingBackend(CountingBackend):
    """A device whose storage replaces the runner with a script that would leave a trace."""

    def __init__(self, *args, canary: Path, **kwargs):
        super().__init__(*args, **kwargs)
        self.canary = canary

    async def push(self, local_path, remote_path, mode=0o644):
        await super().push(local_path, remote_path, mode)
        if remote_path.endswith(RUNNER_NAME):
            Path(remote_path).write_text(f"#!/bin/sh\ntouch {self.canary}\n")


def test_wrong_hash_on_the_device_refuses_to_run(host_artifact, tmp_path):
    backend = TamperingBackend(tmp_path / "device", canary=tmp_path / "ran")

    async def scenario():
        facts = await backend.facts()
        await measure(backend, facts, host_artifact, runs=1, cache_dir=tmp_path / "cache")

    with pytest.raises(BundleHashError, match=f"{RUNNER_NAME} of bundle .* refusing to run"):
        run(scenario(), backend)
    assert not (tmp_path / "ran").exists()
    assert not any(argv[0].endswith(RUNNER_NAME) for argv in backend.runs)
    assert not list((tmp_path / "device").rglob(RUNNER_NAME))  # the bad file was removed


def test_phone_that_corrupts_pushes_runs_nothing(phone, arm_artifact, tmp_path):
    phone.corrupt_pushes = True
    backend = adb_backend(phone, tmp_path)

    async def scenario():
        facts = await backend.facts()
        await measure(backend, facts, arm_artifact, runs=1, cache_dir=tmp_path / "cache")

    with pytest.raises(BundleHashError, match="refusing to run"):
        run(scenario(), backend)
    assert not any(" -n 1 " in c for c in phone.commands)


class LyingBackend(LocalBackend):
    """A device whose runner prints `report` (and exits with `status`)."""

    def __init__(self, *args, report: str, status: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.report, self.status = report, status

    async def run(self, argv, timeout):
        if argv[0].endswith(RUNNER_NAME):
            return self.status, self.report, "kiln-runner: error: the model failed"
        return await super().run(argv, timeout)


def good_report(manifest, runs=5, warmup=2) -> dict:
    return {"threads": 2, "warmup": warmup, "runs": runs,
            "latency_ns": {"median": 2000, "p10": 1900, "p90": 2500, "min": 1800, "max": 3000},
            "kernels": [{"index": i, "symbol": k["symbol"], "block": k["block"], "median_ns": 600}
                        for i, k in enumerate(manifest["kernels"])]}


def report_with_samples(manifest, runs=5) -> dict:
    report = good_report(manifest, runs)
    for k in report["kernels"]:
        k.update(p10_ns=500, p90_ns=700, samples_ns=[500, 600, 600, 650, 700][:runs])
    return report


def test_per_run_samples_are_parsed_and_checked(host_artifact):
    manifest = host_artifact.manifest
    parsed = parse_runner_output(json.dumps(report_with_samples(manifest)), manifest, 5, 2)
    assert parsed.kernel_runs == ((5e-7, 6e-7, 6e-7, 6.5e-7, 7e-7),) * 3
    assert parse_runner_output(json.dumps(good_report(manifest)), manifest, 5, 2).kernel_runs == ()
    for path, value, message in [
        (("kernels", 0, "samples_ns"), [500, 600], "not a list of 5 run times"),
        (("kernels", 1, "samples_ns"), [500, -1, 600, 600, 600], r"samples_ns\[1\]"),
        (("kernels", 2, "samples_ns"), [500, 600, float("nan"), 600, 600], "contains NaN"),
        (("kernels", 0, "p10_ns"), 900, "not ordered"),
        (("kernels", 0, "p90_ns"), 0, "latencies must be finite"),
    ]:
        with pytest.raises(MeasurementError, match=message):
            parse_runner_output(edit(report_with_samples(manifest), path, value), manifest, 5, 2)
    partial = report_with_samples(manifest)
    del partial["kernels"][1]["samples_ns"]
    with pytest.raises(MeasurementError, match="some kernels only"):
        parse_runner_output(json.dumps(partial), manifest, 5, 2)


def test_peak_resident_memory_is_parsed_when_printed_and_checked(host_artifact):
    manifest = host_artifact.manifest
    printed = {**good_report(manifest), "peak_rss_bytes": 3_145_728}
    assert parse_runner_output(json.dumps(printed), manifest, 5, 2).peak_rss_bytes == 3_145_728
    # a runner built before it printed the figure: accepted, the figure unknown
    assert parse_runner_output(json.dumps(good_report(manifest)), manifest, 5, 2) \
        .peak_rss_bytes is None
    for value in (0, -4096, "3145728", True, 1.5e6, 1 << 50):
        with pytest.raises(MeasurementError, match="peak_rss_bytes is .*not an integer in"):
            parse_runner_output(json.dumps({**printed, "peak_rss_bytes": value}), manifest, 5, 2)


def edit(report: dict, path: tuple, value) -> str:
    target = report
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return json.dumps(report)


BAD_REPORTS = {
    "negative": (("kernels", 0, "median_ns"), -5, "latencies must be finite, > 0"),
    "zero": (("kernels", 1, "median_ns"), 0, "latencies must be finite, > 0"),
    "absurd": (("kernels", 2, "median_ns"), 61 * 10**9, "< 60 s"),
    "string": (("kernels", 0, "median_ns"), "600", "not a number"),
    "total": (("latency_ns", "median"), -1, r"latency_ns.median"),
    "unordered": (("latency_ns", "p90"), 1000, "not ordered"),
    "renamed": (("kernels", 0, "symbol"), "k0_evil", "the artifact's is 'k0_matmul'"),
    "runs": (("runs",), 7, "asked for runs=5"),
    "threads": (("threads",), -1, "threads is -1"),
}


@pytest.mark.parametrize("case", sorted(BAD_REPORTS))
def test_bad_reports_are_refused(host_artifact, case):
    path, value, message = BAD_REPORTS[case]
    text = edit(good_report(host_artifact.manifest), path, value)
    with pytest.raises(MeasurementError, match=message):
        parse_runner_output(text, host_artifact.manifest, runs=5, warmup=2)


def test_malformed_reports_are_refused(host_artifact):
    manifest = host_artifact.manifest
    good = json.dumps(good_report(manifest))
    assert parse_runner_output(good, manifest, 5, 2).kernel_seconds == (6e-07,) * 3
    for text, message in [
        (good.replace("600", "NaN", 1), "contains NaN"),
        (good.replace("600", "Infinity", 1), "contains Infinity"),
        (good.replace("600", "1e400", 1), "finite"),
        ("not json", "not JSON"),
        ("[1, 2]", "not a JSON object"),
        (good[:-10], "not JSON"),
        (good + " " * 10**6, "bytes; at most"),
        (json.dumps({**good_report(manifest), "kernels": good_report(manifest)["kernels"][:2]}),
         "lists 2 kernels; the artifact has 3"),
    ]:
        with pytest.raises(MeasurementError, match=message):
            parse_runner_output(text, manifest, 5, 2)


def test_lying_device_is_refused_end_to_end(host_artifact, tmp_path):
    report = good_report(host_artifact.manifest, runs=5).copy()
    text = json.dumps(report).replace('"median_ns": 600', '"median_ns": NaN', 1)
    for backend, message in [
        (LyingBackend(tmp_path / "a", report=text), "contains NaN"),
        (LyingBackend(tmp_path / "b", report="", status=1), "exit status 1.*model failed"),
    ]:
        async def scenario(backend=backend):
            facts = await backend.facts()
            await measure(backend, facts, host_artifact, runs=5, cache_dir=tmp_path / "cache")

        with pytest.raises(MeasurementError, match=message):
            run(scenario(), backend)
