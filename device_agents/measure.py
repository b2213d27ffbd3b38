"""Measuring an artifact on a device: bundle, push, check on the device, run, parse, validate.

    bundle = build_bundle(artifact, cache)          # runner + weights + inputs, named by content
    measurement = await measure(backend, facts, artifact, runs=20, repeats=3, cache_dir=cache)

A bundle holds the artifact's `bin/kiln-runner`, its `weights.bin` and one `input_<i>.npy` per
model input (random valid values, in the runner's .npy format and the manifest's input order).
Its id is the sha256 of the sorted {file name: sha256} map, and it lives on the device in
`<work dir>/bundles/<id>/`. Files already there with the right hash are not pushed again; before
the runner starts, every file's sha256 is computed on the device itself (`sha256sum`, toybox's on
Android) and a mismatch refuses the run. The remote command is built only from Kiln's values (the
bundle folder, fixed file names, numbers), never from the model's names.

The runner prints one JSON object (see kiln/runtime/runner.c); `parse_runner_output` accepts it only
when it is a bounded, well-formed report for exactly the manifest's kernels, with every latency
finite, > 0 and < MAX_LATENCY_S. Each of `repeats` runner invocations gives one sample per kernel
(the runner's median over `runs` timed runs) and, from runners that print them (`samples_ns`, up to
100 runs), the kernel's time in every run; older runners' reports without them are still accepted.
Likewise `peak_rss_bytes`, the runner process's peak resident memory: the measurement keeps the
largest over the invocations, or None when a runner (built before it was printed) lacks it.
"""
from __future__ import annotations

import hashlib
import json
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import ValidationError

from device_agents.backends import DeviceBackend
from device_agents.facts import HardwareFacts, has_driver_for
from device_agents.matching import gpu_mismatch
from device_agents.protocol import (
    MAX_KERNELS,
    MAX_LATENCY_S,
    MAX_PEAK_RSS_BYTES,
    MAX_REPEATS,
    MAX_RUN_SAMPLES,
    MAX_RUNS,
    KernelSamples,
    LatencySummary,
)
from kiln.files import write_atomic
from kiln.runtime.artifact import RUNNER, WEIGHTS, Artifact
from kiln.runtime.inputs import random_inputs
from kiln.target import target

RUNNER_NAME = "kiln-runner"
WEIGHTS_NAME = "weights.bin"
TOTAL_KEYS = ("median", "p10", "p90", "min", "max")
OUTPUT_BASE_BYTES = 4096
OUTPUT_BYTES_PER_KERNEL = 512
OUTPUT_BYTES_PER_SAMPLE = 24  # "12345678901234567890, "
RUNNER_MAX_SAMPLES = 100  # runner.c's MAX_PRINTED_SAMPLES


class MeasurementError(Exception):
    """The artifact cannot be measured on this device, or the device's report was refused."""


class BundleHashError(MeasurementError):
    """A bundle file on the device does not have the hash it was pushed with; nothing ran."""


@dataclass(frozen=True)
class Bundle:
    id: str  # sha256 of the sorted {name: sha256} map
    files: dict[str, Path]  # name on the device -> local file
    hashes: dict[str, str]  # name -> sha256
    inputs: tuple[str, ...]  # input file names in the manifest's order

    def remote_dir(self, work_dir: str) -> str:
        return f"{work_dir.rstrip('/')}/bundles/{self.id}"


@dataclass(frozen=True)
class RunnerReport:
    """One runner invocation's report, validated."""

    threads: int
    runs: int
    warmup: int
    total: LatencySummary
    kernel_seconds: tuple[float, ...]  # per manifest kernel, in order
    kernel_runs: tuple[tuple[float, ...], ...] = ()  # per kernel, every run's time (when printed)
    peak_rss_bytes: int | None = None  # the process's peak resident memory (when printed)


@dataclass(frozen=True)
class Measurement:
    kernels: list[KernelSamples]
    totals: list[LatencySummary]  # one per runner invocation
    threads: int
    runs: int
    warmup: int
    runner_version: str
    runner_sha256: str
    artifact_hash: str
    bundle_id: str
    emulated: bool
    peak_rss_bytes: int | None = None  # the largest of the invocations' (None: not reported)


# ---------------------------------------------------------------------------------------------
# Bundles

def _sha256_file(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
    return sha.hexdigest()


def build_bundle(artifact: Artifact, cache_dir: str | Path, seed: int = 0) -> Bundle:
    """The bundle of `artifact`: its runner, weights and seeded random inputs (under cache_dir)."""
    folder = Path(cache_dir) / "inputs" / artifact.manifest["content_hash"] / str(seed)
    values = random_inputs(artifact.inputs, seed=seed)
    files = {RUNNER_NAME: artifact.runner, WEIGHTS_NAME: artifact.weights}
    hashes = {RUNNER_NAME: artifact.manifest["files"][RUNNER],
              WEIGHTS_NAME: artifact.manifest["files"][WEIGHTS]}
    names = []
    for i, info in enumerate(artifact.inputs):
        name = f"input_{i}.npy"
        path = folder / name
        if not path.is_file():
            array = np.ascontiguousarray(np.asarray(values[info.name], dtype=info.dtype))
            with tempfile.TemporaryFile() as f:
                np.save(f, array, allow_pickle=False)
                f.seek(0)
                write_atomic(path, f.read())
        files[name] = path
        hashes[name] = _sha256_file(path)
        names.append(name)
    ident = hashlib.sha256(json.dumps(hashes, sort_keys=True).encode()).hexdigest()
    return Bundle(ident, files, hashes, tuple(names))


async def push_bundle(backend: DeviceBackend, bundle: Bundle) -> str:
    """Push the files the device lacks (or holds with another hash); return the bundle folder."""
    remote = bundle.remote_dir(backend.work_dir)
    found = await backend.sha256_many([f"{remote}/{name}" for name in bundle.hashes])
    for name, digest in bundle.hashes.items():
        path = f"{remote}/{name}"
        if found[path] != digest:
            await backend.push(str(bundle.files[name]), path,
                               mode=0o755 if name == RUNNER_NAME else 0o644)
    return remote


async def verify_bundle(backend: DeviceBackend, bundle: Bundle) -> None:
    """Hash every bundle file on the device; remove a mismatching one and refuse."""
    remote = bundle.remote_dir(backend.work_dir)
    hashes = await backend.sha256_many([f"{remote}/{name}" for name in bundle.hashes])
    for name, digest in bundle.hashes.items():
        path = f"{remote}/{name}"
        found = hashes[path]
        if found != digest:
            await backend.remove(path)
            raise BundleHashError(
                f"{backend.name}: {name} of bundle {bundle.id[:12]} has sha256 "
                f"{found or '(missing)'} on the device, expected {digest}; refusing to run it")


# ---------------------------------------------------------------------------------------------
# Running and validating

def check_compatible(artifact: Artifact, facts: HardwareFacts, device: str) -> None:
    if artifact.arch != facts.arch:
        raise MeasurementError(
            f"the artifact was built for {artifact.arch} but {device} is {facts.arch}; "
            f"{artifact.arch} artifacts are measured on {artifact.arch} devices"
            + (" (phones over adb)" if artifact.arch == "aarch64" else ""))
    missing = [f for f in artifact.isa if f not in facts.isa]
    if missing:
        raise MeasurementError(f"the artifact uses {', '.join(missing)}, which {device} lacks")
    gpu = gpu_mismatch(artifact.manifest["target"].get("gpu_arch", ""), facts, device)
    if gpu:
        raise MeasurementError(gpu)
    name = artifact.manifest["target"]["name"]
    if not has_driver_for(facts.model_dump(), name):
        raise MeasurementError(f"the artifact was built for {name}, whose kernels run on a "
                               f"{target(name).backend} device; {device} has none")


def runner_argv(remote_dir: str, bundle: Bundle, runs: int, warmup: int,
                threads: int | None) -> list[str]:
    argv = [f"{remote_dir}/{RUNNER_NAME}", "-n", str(int(runs)), "-w", str(int(warmup))]
    if threads is not None:
        argv += ["-t", str(int(threads))]
    return [*argv, f"{remote_dir}/{WEIGHTS_NAME}", *(f"{remote_dir}/{n}" for n in bundle.inputs)]


def max_output_bytes(kernels: int, runs: int = 0) -> int:
    per_kernel = OUTPUT_BYTES_PER_KERNEL + OUTPUT_BYTES_PER_SAMPLE * min(runs, RUNNER_MAX_SAMPLES)
    return OUTPUT_BASE_BYTES + per_kernel * kernels


def _reject_constant(name: str) -> Any:
    raise MeasurementError(f"the runner's report contains {name}")


def _seconds(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MeasurementError(f"the runner's report: {what} is not a number: {value!r}")
    seconds = float(value) / 1e9
    if not math.isfinite(seconds) or seconds <= 0 or seconds >= MAX_LATENCY_S:
        raise MeasurementError(f"the runner's report: {what} is {value!r} ns; latencies must be "
                               f"finite, > 0 and < {MAX_LATENCY_S:g} s")
    return seconds


def _count(data: dict, key: str, low: int, high: int) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise MeasurementError(f"the runner's report: {key} is {value!r}, not an integer in "
                               f"[{low}, {high}]")
    return value


def parse_runner_output(stdout: str, manifest: dict[str, Any], runs: int,
                        warmup: int) -> RunnerReport:
    """Validate one runner report (runner.c's JSON) against the manifest and the request."""
    expected = manifest["kernels"]
    if len(expected) > MAX_KERNELS:
        raise MeasurementError(f"the artifact has {len(expected)} kernels; at most {MAX_KERNELS}")
    size = len(stdout.encode())
    limit = max_output_bytes(len(expected), runs)
    if size > limit:
        raise MeasurementError(f"the runner's report is {size} bytes; at most {limit} for "
                               f"{len(expected)} kernels and {runs} runs")
    try:
        data = json.loads(stdout, parse_constant=_reject_constant)
    except ValueError as exc:
        raise MeasurementError(f"the runner's report is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise MeasurementError("the runner's report is not a JSON object")
    threads = _count(data, "threads", 0, 1024)
    peak_rss = (_count(data, "peak_rss_bytes", 1, MAX_PEAK_RSS_BYTES)
                if "peak_rss_bytes" in data else None)
    if _count(data, "runs", 1, MAX_RUNS) != runs or _count(data, "warmup", 0, MAX_RUNS) != warmup:
        raise MeasurementError(f"the runner's report has runs={data['runs']} warmup="
                               f"{data['warmup']}; asked for runs={runs} warmup={warmup}")
    latency = data.get("latency_ns")
    if not isinstance(latency, dict):
        raise MeasurementError("the runner's report has no latency_ns object")
    total = {key: _seconds(latency.get(key), f"latency_ns.{key}") for key in TOTAL_KEYS}
    try:
        summary = LatencySummary(**{f"{k}_s": v for k, v in total.items()})
    except ValidationError as exc:
        raise MeasurementError(f"the runner's report: latency_ns: "
                               f"{exc.errors()[0]['msg']}") from None
    kernels = data.get("kernels")
    if not isinstance(kernels, list):
        raise MeasurementError("the runner's report has no kernels list")
    if len(kernels) != len(expected):
        raise MeasurementError(f"the runner's report lists {len(kernels)} kernels; the artifact "
                               f"has {len(expected)}")
    seconds, every_run = [], []
    for i, (got, want) in enumerate(zip(kernels, expected)):
        if not isinstance(got, dict):
            raise MeasurementError(f"the runner's report: kernel #{i} is not an object")
        if (got.get("index"), got.get("symbol"), got.get("block")) != (i, want["symbol"],
                                                                        want["block"]):
            raise MeasurementError(
                f"the runner's report: kernel #{i} is {got.get('symbol')!r} of block "
                f"{got.get('block')!r}; the artifact's is {want['symbol']!r} of {want['block']!r}")
        name = f"kernel #{i} ({want['symbol']})"
        median = _seconds(got.get("median_ns"), f"{name} median_ns")
        seconds.append(median)
        if "p10_ns" in got or "p90_ns" in got:
            p10 = _seconds(got.get("p10_ns"), f"{name} p10_ns")
            p90 = _seconds(got.get("p90_ns"), f"{name} p90_ns")
            if not p10 <= median <= p90:
                raise MeasurementError(f"the runner's report: {name} has p10 {p10!r} s, median "
                                       f"{median!r} s, p90 {p90!r} s, which are not ordered")
        if "samples_ns" in got:
            samples = got["samples_ns"]
            if not isinstance(samples, list) or len(samples) != runs:
                raise MeasurementError(f"the runner's report: {name} samples_ns is not a list of "
                                       f"{runs} run times")
            every_run.append(tuple(_seconds(v, f"{name} samples_ns[{j}]")
                                   for j, v in enumerate(samples)))
    if every_run and len(every_run) != len(expected):
        raise MeasurementError("the runner's report gives samples_ns for some kernels only")
    return RunnerReport(threads, runs, warmup, summary, tuple(seconds), tuple(every_run), peak_rss)


async def measure(backend: DeviceBackend, facts: HardwareFacts, artifact: Artifact, *,
                  runs: int, warmup: int = 2, repeats: int = 3, threads: int | None = None,
                  timeout_s: float = 600.0, cache_dir: str | Path) -> Measurement:
    """Per-kernel latency samples of `artifact` on the device behind `backend`."""
    if not 1 <= runs <= MAX_RUNS or not 0 <= warmup <= MAX_RUNS or not 1 <= repeats <= MAX_REPEATS:
        raise MeasurementError(f"runs must be in [1, {MAX_RUNS}], warmup in [0, {MAX_RUNS}], "
                               f"repeats in [1, {MAX_REPEATS}]")
    check_compatible(artifact, facts, backend.name)
    bundle = build_bundle(artifact, cache_dir)
    remote = await push_bundle(backend, bundle)
    await verify_bundle(backend, bundle)
    argv = runner_argv(remote, bundle, runs, warmup, threads)
    reports = []
    for _ in range(repeats):
        code, out, err = await backend.run(argv, timeout_s)
        if code != 0:
            detail = (err.strip() or out.strip())[-1000:]
            raise MeasurementError(f"the runner failed on {backend.name} (exit status {code}): "
                                   f"{detail}")
        reports.append(parse_runner_output(out, artifact.manifest, runs, warmup))
    per_run = all(r.kernel_runs for r in reports)
    peak_rss = [r.peak_rss_bytes for r in reports]
    kernels = [KernelSamples(symbol=k["symbol"], block=k["block"],
                             samples_s=[r.kernel_seconds[i] for r in reports],
                             run_samples_s=[s for r in reports for s in r.kernel_runs[i]]
                             [:MAX_RUN_SAMPLES] if per_run else [])
               for i, k in enumerate(artifact.manifest["kernels"])]
    return Measurement(
        kernels=kernels, totals=[r.total for r in reports], threads=reports[-1].threads,
        runs=runs, warmup=warmup, runner_version=f"kiln-runner {artifact.manifest['kiln_version']}",
        runner_sha256=bundle.hashes[RUNNER_NAME], artifact_hash=artifact.manifest["content_hash"],
        bundle_id=bundle.id, emulated=facts.emulated,
        peak_rss_bytes=max(peak_rss) if None not in peak_rss else None)
