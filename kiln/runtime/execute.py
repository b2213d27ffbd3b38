"""Running an artifact from Python either way: in-process (the loader) when it was built for this
machine, else through its runner under qemu user-mode emulation."""
from __future__ import annotations

import json
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kiln.errors import KilnError
from kiln.runtime.artifact import Artifact
from kiln.runtime.loader import CompiledModel, bind_inputs, check_input

QEMU_SYSROOTS = {"aarch64": "/usr/aarch64-linux-gnu", "x86_64": "/usr/x86_64-linux-gnu"}


@dataclass(frozen=True)
class RunnerResult:
    timing: dict[str, Any]  # the runner's JSON (see runner.c)
    outputs: list[np.ndarray]  # in the model's output order; empty unless asked for


def runs_natively(artifact: Artifact) -> bool:
    return artifact.arch == platform.machine()


def runner_prefix(artifact: Artifact) -> list[str]:
    """The command that starts the artifact's runner: itself, or qemu-<arch> running it."""
    if runs_natively(artifact):
        return [str(artifact.runner)]
    qemu = shutil.which(f"qemu-{artifact.arch}")
    if qemu is None:
        raise KilnError(f"this artifact was built for {artifact.arch}; running it on this "
                        f"{platform.machine()} machine needs qemu-{artifact.arch} (install it with "
                        f"`apt-get install qemu-user`), or run bin/kiln-runner on the device")
    return [qemu, "-L", QEMU_SYSROOTS.get(artifact.arch, "/"), str(artifact.runner)]


def run_runner(artifact: Artifact, inputs: Mapping[str, Any], runs: int = 1, warmup: int = 0,
               threads: int | None = None, keep_outputs: bool = True) -> RunnerResult:
    """Run the artifact's runner on `inputs` (by input name), checked first like the loader does."""
    values = bind_inputs(artifact.inputs, (), inputs)
    arrays = [check_input(info, v) for info, v in zip(artifact.inputs, values)]
    with tempfile.TemporaryDirectory(prefix="kiln-run-") as tmp:
        folder = Path(tmp)
        paths = [folder / f"input_{i}.npy" for i in range(len(arrays))]
        for path, array in zip(paths, arrays):
            np.save(path, array)
        argv = [*runner_prefix(artifact), "-n", str(runs), "-w", str(warmup)]
        if threads is not None:
            argv += ["-t", str(threads)]
        if keep_outputs:
            argv += ["-o", str(folder)]
        done = subprocess.run([*argv, str(artifact.weights), *map(str, paths)],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise KilnError(f"the runner failed (exit status {done.returncode}): "
                            f"{done.stderr.strip() or done.stdout.strip()}")
        outputs = [np.load(folder / f"output_{i}.npy") for i in range(len(artifact.outputs))
                   ] if keep_outputs else []
    return RunnerResult(json.loads(done.stdout), outputs)


def run_artifact(artifact: Artifact, inputs: Mapping[str, Any],
                 threads: int | None = None) -> list[np.ndarray]:
    """The outputs, in the model's order, of one run on `inputs` (by input name)."""
    if runs_natively(artifact):
        return CompiledModel(artifact, threads).run(**inputs)
    return run_runner(artifact, inputs, threads=threads).outputs
