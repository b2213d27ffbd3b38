"""OpenMP's workers spin briefly, then sleep, between kernels unless the user chose a wait policy: in the runner (a
constructor that runs before libgomp reads the environment) and in the in-process loader (the
environment set while the library and its libgomp load, then restored). libgomp's verbose
environment display shows the spin count it took: Kiln's 1000 unless the user chose (libgomp's own default is 300000)."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from kiln.runtime import openmp
from kiln.runtime.artifact import build_artifact, open_artifact
from kiln.runtime.openmp import SPIN_COUNT, USER_WAIT_SETTINGS
from kiln.target import target

X = np.zeros((4, 8), np.float32)
VERBOSE = {"OMP_DISPLAY_ENV": "VERBOSE"}


def spin_count(stderr_and_stdout: str) -> str:
    line = next(line for line in stderr_and_stdout.splitlines() if "GOMP_SPINCOUNT" in line)
    return line.split("=")[1].strip().strip("'")


@pytest.mark.parametrize(("user", "spins"), [
    ({}, str(SPIN_COUNT)), ({"OMP_WAIT_POLICY": "ACTIVE"}, "30000000000"),
    ({"GOMP_SPINCOUNT": "1234"}, "1234")])
def test_the_runner_spins_briefly_unless_told_otherwise(mlp_artifact, tmp_path, user, spins):
    artifact = open_artifact(mlp_artifact)
    np.save(tmp_path / "x.npy", X)
    done = subprocess.run([str(artifact.runner), "-n", "1", str(artifact.weights),
                           str(tmp_path / "x.npy")], capture_output=True, text=True, check=True,
                          env={**VERBOSE, **user})
    assert spin_count(done.stdout + done.stderr) == spins


LOAD = """
import os, sys
import kiln
model = kiln.load(sys.argv[1])
print("after load:", os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT"), flush=True)
"""


@pytest.mark.parametrize(("user", "spins", "after"), [
    ({}, str(SPIN_COUNT), "None None"), ({"OMP_WAIT_POLICY": "ACTIVE"}, "30000000000", "ACTIVE None")])
def test_the_loader_spins_briefly_and_leaves_the_environment_as_it_was(
        mlp_artifact, user, spins, after):
    inherited = {k: v for k, v in os.environ.items() if k not in USER_WAIT_SETTINGS}
    done = subprocess.run([sys.executable, "-c", LOAD, str(mlp_artifact)], capture_output=True,
                          text=True, check=True, env={**inherited, **VERBOSE, **user})
    assert spin_count(done.stdout + done.stderr) == spins
    assert f"after load: {after}" in done.stdout


def test_the_runner_takes_its_spin_count_from_the_loaders_source(mlp_model, tmp_path,
                                                                  monkeypatch):
    monkeypatch.setattr(openmp, "SPIN_COUNT", 777)
    path = tmp_path / "mlp.kiln"
    build_artifact(mlp_model.plan, mlp_model.kernels, target("host"), {"model": "mlp"}, path)
    artifact = open_artifact(path)
    np.save(tmp_path / "x.npy", X)
    done = subprocess.run([str(artifact.runner), "-n", "1", str(artifact.weights),
                           str(tmp_path / "x.npy")], capture_output=True, text=True, check=True,
                          env=VERBOSE)
    assert spin_count(done.stdout + done.stderr) == "777"
