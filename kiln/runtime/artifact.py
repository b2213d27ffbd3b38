"""The artifact: one zip file (`model.kiln`) holding everything needed to run a compiled model.

Members:

- `manifest.json`: format and Kiln version, model name, target, partitioner, the model's inputs
  and outputs (model names, dtypes, shapes; positions are the library's and runner's order),
  the kernel list, memory totals, `files` (SHA-256 of every other member) and `content_hash`
  (SHA-256 of the sorted `files` JSON), which names the artifact.
- `weights.bin`: the weights region (see kiln.runtime.memory), read by `kiln_model_create`.
- `src/`: the kernel sources (one file per distinct kernel body: C, or OpenCL C `.cl` that the
  OpenCL driver also embeds and builds on the device at run time), the driver `model.c`,
  `kiln_model.h` and `runner.c`.
- `lib/libkiln_model.so`: the kernels and driver as a shared library (kiln_model.h's interface).
- `lib/kernels.sm_<NN>.cubin`, `lib/kernels.compute_<NN>.ptx` (CUDA targets): the kernels as nvcc
  built them (`.cu` sources in `src/`), also embedded in the library and the runner.
- `bin/kiln-runner`: the same, statically linked with runner.c (usage in runner.c).
- `plan.json`: the fusion plan's blocks, every kernel's arguments with their locations, and
  the memory plan. `report.json`: the fusion report with memory totals.

The file is written to a temporary name next to its destination and renamed into place.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
import time
import zipfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import kiln
from kiln.codegen import Kernel
from kiln.codegen.backend import backend_for
from kiln.errors import KilnError
from kiln.plan import FusionPlan
from kiln.files import cache_dir, temporary_beside
from kiln.runtime import cuda_driver, driver, nvcc, opencl_driver
from kiln.runtime.memory import MemoryPlan, plan_memory, weights_blob
from kiln.runtime.toolchain import (
    BuildCache,
    build_timeout,
    compiler_for,
    link_executable,
    link_shared,
)
from kiln.target import Target

FORMAT = "kiln-artifact"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
WEIGHTS = "weights.bin"
LIBRARY = "lib/libkiln_model.so"
RUNNER = "bin/kiln-runner"
PLAN = "plan.json"
REPORT = "report.json"
EXECUTABLES = (LIBRARY, RUNNER)
MEMBER_NAME = re.compile(r"(src|lib|bin)/[A-Za-z0-9_.-]+|[A-Za-z0-9_.-]+")
HASH = re.compile(r"[0-9a-f]{64}")


class ArtifactError(KilnError):
    """An artifact file is missing, corrupt, or not one Kiln can run here."""


# ---------------------------------------------------------------------------------------------
# Building

def build_artifact(plan: FusionPlan, kernels: Sequence[Kernel], target: Target,
                   report: dict[str, Any], out_path: str | Path,
                   cache: BuildCache | None = None, timeout: float | None = None) -> dict[str, Any]:
    """Compile `kernels` for `target` and write the artifact; return the report it holds.

    Compiling and linking must finish within `timeout` seconds (default: `build_timeout` of the
    sources' size); a step still running then is killed and raises a ToolchainError naming it."""
    views = {b.id for b in plan.blocks if b.is_view}
    kernels = [k for k in kernels if k.block_id not in views]  # views alias, they run nothing
    memory = plan_memory(plan, kernels)
    units = driver.kernel_units(kernels)
    sources = _sources(plan, kernels, memory, units, target)
    members = {f"src/{name}": text.encode() for name, text in sources.items()}
    seconds = timeout if timeout is not None else build_timeout(
        sum(len(text) for text in members.values()))
    deadline = time.monotonic() + seconds
    with tempfile.TemporaryDirectory(prefix="kiln-build-") as tmp:
        members |= _binaries(sources, units, target, cache or BuildCache(), Path(tmp), deadline)
    members[WEIGHTS] = weights_blob(plan, kernels, memory)
    members[PLAN] = _json(plan_json(plan, kernels, memory, units))
    full_report = report | memory_report(memory, kernels, units)
    members[REPORT] = _json(full_report)
    manifest = _manifest(plan, kernels, target, memory, units, members)
    _write_zip(Path(out_path), {MANIFEST: _json(manifest), **members})
    return full_report


def memory_report(memory: MemoryPlan, kernels: Sequence[Kernel],
                  units: dict[str, driver.KernelUnit]) -> dict[str, Any]:
    return {
        "compiled_kernels": len(kernels),
        "distinct_kernels": len({u.function for u in units.values()}),
        "peak_memory_bytes": memory.peak_bytes,
        "memory": {"arena_bytes": memory.arena_bytes, "weights_bytes": memory.weights_bytes,
                   "scratch_bytes": memory.scratch_bytes, "io_bytes": memory.io_bytes},
    }


# The host drivers by `Backend.driver`: the module writing model.c, and whether the kernels are
# host C compiled into the library (else the driver builds them on the device at run time).
DRIVERS = {"c": (driver, True), "opencl": (opencl_driver, False), "cuda": (cuda_driver, False)}


def _sources(plan: FusionPlan, kernels: Sequence[Kernel], memory: MemoryPlan,
             units: dict[str, driver.KernelUnit], target: Target) -> dict[str, str]:
    """File name -> source: one file per distinct kernel body, the driver and the runner."""
    backend = backend_for(target)
    sources = {f"{u.function}{backend.toolchain.source_suffix}": u.source for u in units.values()}
    host_driver, _ = DRIVERS[backend.driver]
    sources["model.c"] = host_driver.model_source(plan.graph, kernels, memory, units)
    sources[driver.HEADER_NAME] = driver.header_text()
    runner = backend_for(target).runner
    sources[runner] = resources.files("kiln.runtime").joinpath(runner).read_text()
    return sources


def _binaries(sources: dict[str, str], units: dict[str, driver.KernelUnit], target: Target,
              cache: BuildCache, folder: Path, deadline: float) -> dict[str, bytes]:
    """The shared library and the runner; objects are named in compiler errors by `labels`."""
    backend = backend_for(target)
    labels = {"model.c": "the model driver", backend.runner: "the runner"}
    functions = {}  # label -> function, of the kernels compiled on the host
    if DRIVERS[backend.driver][1]:
        for symbol, unit in units.items():
            label = labels.setdefault(f"{unit.function}{backend.toolchain.source_suffix}",
                                      f"kernel {symbol}")
            functions[label] = unit.function
    compiled = {labels[name]: driver.with_header(text)
                for name, text in sources.items() if name in labels}
    images = {}
    if backend.driver == "cuda":  # nvcc builds the kernels now; the images are linked in
        built = nvcc.build_images(cuda_driver.program_source(list(units.values())),
                                  target.gpu_arch, deadline, cache.root)
        compiled["the CUDA kernel images"] = cuda_driver.images_source(built)
        images = dict(zip(built.names, (built.cubin, built.ptx)))
    compiler = compiler_for(target)
    objects = cache.objects(compiler, compiled, deadline, kernels=functions)
    runner = objects.pop("the runner")
    link_shared(compiler, list(objects.values()), folder / "model.so", deadline)
    link_executable(compiler, [*objects.values(), runner], folder / "runner", deadline,
                    static=backend.toolchain.static_runner)
    return {LIBRARY: (folder / "model.so").read_bytes(), RUNNER: (folder / "runner").read_bytes(),
            **images}


def plan_json(plan: FusionPlan, kernels: Sequence[Kernel], memory: MemoryPlan,
              units: dict[str, driver.KernelUnit]) -> dict[str, Any]:
    graph = plan.graph
    ordered = [kernels[i] for i in memory.kernel_order]
    used = {a for k in ordered for a in k.args} | set(graph.inputs) | set(graph.outputs)
    return {
        "model": graph.name,
        "partitioner": plan.partitioner,
        "inputs": list(graph.inputs),
        "outputs": list(graph.outputs),
        "tensors": {t: {"name": v.source_name, "dtype": v.dtype, "shape": list(v.shape),
                        "constant": v.is_constant}
                    for t, v in graph.tensors.items() if t in used},
        "blocks": [{"id": b.id, "name": b.name, "inputs": list(b.inputs),
                    "outputs": list(b.outputs),
                    "ops": [{"id": o, "type": graph.op_by_id[o].op_type,
                             "name": graph.op_by_id[o].source_name} for o in b.op_ids]}
                   | ({"stage": plan.stages[b.id].to_json()} if b.id in plan.stages else {})
                   for b in plan.blocks],
        "kernels": [{"symbol": k.symbol, "block": k.block_id, "function": units[k.symbol].function,
                     "scratch_bytes": k.scratch_bytes, "schedule": k.schedule,
                     "args": [{"tensor": a, "region": r.region, "where": r.where}
                              for a, r in zip(k.args, binding)]}
                    for k, binding in zip(ordered, memory.bindings)],
        "memory": memory.to_json(),
    }


def _manifest(plan: FusionPlan, kernels: Sequence[Kernel], target: Target, memory: MemoryPlan,
              units: dict[str, driver.KernelUnit], members: dict[str, bytes]) -> dict[str, Any]:
    graph = plan.graph
    files = {name: hashlib.sha256(data).hexdigest() for name, data in sorted(members.items())}

    def tensors(ids: Sequence[str]) -> list[dict[str, Any]]:
        return [{"name": graph.tensors[t].source_name or t, "tensor": t,
                 "dtype": graph.tensors[t].dtype, "shape": list(graph.tensors[t].shape)}
                for t in ids]

    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "kiln_version": kiln.__version__,
        "model": graph.name,
        "target": {"name": target.name, "arch": target.arch, "isa": list(target.isa),
                   "cc": target.cc, "cflags": list(target.cflags), "backend": target.backend,
                   "gpu_arch": target.gpu_arch},
        "partitioner": plan.partitioner,
        "inputs": tensors(graph.inputs),
        "outputs": tensors(graph.outputs),
        "kernels": [{"symbol": kernels[i].symbol, "block": kernels[i].block_id,
                     "function": units[kernels[i].symbol].function}
                    for i in memory.kernel_order],
        "memory": memory_report(memory, kernels, units)["memory"],
        "peak_memory_bytes": memory.peak_bytes,
        "files": files,
        "content_hash": _content_hash(files),
    }


def _content_hash(files: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def _json(value: Any) -> bytes:
    return json.dumps(value, indent=2, default=str).encode()


def _write_zip(path: Path, members: dict[str, bytes]) -> None:
    with temporary_beside(path) as tmp:
        with zipfile.ZipFile(tmp, "w") as archive:
            for name, data in members.items():
                info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
                info.compress_type = zipfile.ZIP_STORED if name == WEIGHTS else zipfile.ZIP_DEFLATED
                info.external_attr = (0o755 if name in EXECUTABLES else 0o644) << 16
                archive.writestr(info, data)
        os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# Reading

@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]

    def describe(self) -> str:
        return f"{self.dtype} {list(self.shape)}"


@dataclass(frozen=True)
class Artifact:
    """An artifact checked and extracted into `root` (a cache folder named by its content hash)."""

    root: Path
    manifest: dict[str, Any]

    @property
    def arch(self) -> str:
        return self.manifest["target"]["arch"]

    @property
    def isa(self) -> tuple[str, ...]:
        return tuple(self.manifest["target"]["isa"])

    @property
    def inputs(self) -> tuple[TensorInfo, ...]:
        return tuple(_tensor_info(t) for t in self.manifest["inputs"])

    @property
    def outputs(self) -> tuple[TensorInfo, ...]:
        return tuple(_tensor_info(t) for t in self.manifest["outputs"])

    @property
    def weights(self) -> Path:
        return self.root / WEIGHTS

    @property
    def library(self) -> Path:
        return self.root / LIBRARY

    @property
    def runner(self) -> Path:
        return self.root / RUNNER

    def kernel_symbols(self) -> list[str]:
        return [k["symbol"] for k in self.manifest["kernels"]]

    @property
    def plan(self) -> dict[str, Any]:
        """plan.json: blocks, kernels with their schedules and arguments, the memory plan."""
        return json.loads((self.root / PLAN).read_text())


def _tensor_info(entry: dict[str, Any]) -> TensorInfo:
    return TensorInfo(entry["name"], entry["dtype"], tuple(entry["shape"]))


def read_manifest(path: str | Path) -> dict[str, Any]:
    with _open_zip(Path(path)) as archive:
        return _manifest_of(archive, Path(path))


def open_artifact(path: str | Path, root: Path | None = None) -> Artifact:
    """Check the artifact at `path` and extract it (once per content hash) under `root`."""
    path = Path(path)
    root = Path(root) if root is not None else cache_dir() / "artifacts"
    with _open_zip(path) as archive:
        manifest = _manifest_of(archive, path)
        folder = root / manifest["content_hash"]
        if not (folder / MANIFEST).is_file():
            _extract(archive, manifest, path, folder)
    return Artifact(folder, manifest)


def _open_zip(path: Path) -> zipfile.ZipFile:
    if not path.is_file():
        raise ArtifactError(f"artifact not found: {path}")
    try:
        return zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as exc:
        raise ArtifactError(f"{path} is not a Kiln artifact (not a readable zip file: {exc})") from exc


def _manifest_of(archive: zipfile.ZipFile, path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads(archive.read(MANIFEST))
    except KeyError:
        raise ArtifactError(f"{path} is not a Kiln artifact: it has no {MANIFEST}") from None
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError) as exc:
        raise ArtifactError(f"{path} is corrupt: cannot read {MANIFEST} ({exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(f"{path} is not a Kiln artifact: {MANIFEST} is not one of Kiln's")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(f"{path} has artifact format version {manifest.get('format_version')}; "
                            f"this Kiln ({kiln.__version__}) reads version {FORMAT_VERSION}")
    files = manifest.get("files")
    if (not isinstance(files, dict) or not HASH.fullmatch(str(manifest.get("content_hash")))
            or _content_hash(files) != manifest["content_hash"]
            or not all(MEMBER_NAME.fullmatch(name) for name in files)):
        raise ArtifactError(f"{path} is corrupt: its manifest's file list does not match its "
                            f"content hash")
    return manifest


def _extract(archive: zipfile.ZipFile, manifest: dict[str, Any], path: Path, folder: Path) -> None:
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
    staging.chmod(0o755)
    try:
        for name, digest in manifest["files"].items():
            _extract_member(archive, name, digest, path, staging / name)
        (staging / MANIFEST).write_text(json.dumps(manifest))
        try:
            os.rename(staging, folder)
        except OSError:
            if not (folder / MANIFEST).is_file():  # not a concurrent extraction that won
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _extract_member(archive: zipfile.ZipFile, name: str, digest: str, path: Path,
                    dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    sha = hashlib.sha256()
    try:
        with archive.open(name) as src, open(dest, "wb") as out:
            while chunk := src.read(1 << 20):
                sha.update(chunk)
                out.write(chunk)
    except KeyError:
        raise ArtifactError(f"{path} is corrupt: it lacks {name}") from None
    except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
        raise ArtifactError(f"{path} is corrupt: cannot read {name} ({exc})") from exc
    if sha.hexdigest() != digest:
        raise ArtifactError(f"{path} is corrupt: {name} does not match its hash in the manifest")
    if name in EXECUTABLES:
        dest.chmod(dest.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
