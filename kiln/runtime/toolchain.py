"""Compiling and linking generated sources for a target with its backend's toolchain, with objects cached by content hash.

An object's key is the SHA-256 of (source, compiler command, flags, `compiler --version`); it
is stored as `<cache>/<key[:2]>/<key>.o` next to its source, both written through a temporary
file and a rename, so a kernel seen before — in this model or any earlier one — is never
compiled again, and concurrent builds never see half-written files.

Kernels (sources written to be concatenated, each defining one global function) are compiled
several to a translation unit: on small kernels gcc's start-up and the system headers cost more
than the code. Each kernel's object is then cut out of the batch object (`ld -r --gc-sections`
rooted at its function), so the cache still holds one object per kernel, exactly what a later
build that needs only that kernel links.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import tempfile
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from kiln.codegen.backend import Toolchain, backend_for
from kiln.errors import KilnError
from kiln.files import cache_dir, temporary_beside, write_atomic
from kiln.target import Target

STDERR_LINES = 20
# A build (every compile and link of an artifact) may take BUILD_BASE_S plus BUILD_S_PER_KB per
# KiB of C source: gcc at -O3 compiles generated kernels at well over 1 KiB/s even on a loaded
# machine, so only a pathological source (or a hung compiler) meets the deadline.
BUILD_BASE_S = 120.0
BUILD_S_PER_KB = 1.0
BUILD_TIMEOUT_ENV = "KILN_BUILD_TIMEOUT"
CROSS_PACKAGES = {"aarch64": "gcc-aarch64-linux-gnu", "x86_64": "gcc-x86-64-linux-gnu"}
# Kernels of up to SOLO_BYTES of source are compiled together, in at most one translation unit
# per CPU and none smaller than BATCH_BYTES (a larger kernel's compile dwarfs gcc's start-up).
SOLO_BYTES = 64 << 10
BATCH_BYTES = 16 << 10
# Each function in its own section, so a kernel's object can be cut out of its batch's; no
# identical-code folding, which would make one kernel's function jump into another's.
BATCH_FLAGS = ("-ffunction-sections", "-fdata-sections", "-fno-ipa-icf")
# A kernel with a non-inlined static function (a GEMM micro-kernel) is compiled alone: GCC
# specialises such a function for the constant arguments of its callers in the translation unit
# (IPA-CP clones), and in a batch it was found to clone fewer than alone.
NOINLINE = re.compile(r"\bnoinline\b")


class ToolchainError(KilnError):
    """The C compiler is missing or rejected generated code."""


@dataclass(frozen=True)
class Compiler:
    command: str  # resolved path of the compiler
    flags: tuple[str, ...]
    version: str  # first line of `--version`
    arch: str
    link_flags: tuple[str, ...] = ()  # the backend's, for both links
    libraries: tuple[str, ...] = ()

    def key(self, source: str) -> str:
        text = json.dumps([source, self.command, self.flags, self.version])
        return hashlib.sha256(text.encode()).hexdigest()


def compiler_for(target: Target) -> Compiler:
    """The compiler of the target's backend toolchain, with the target's ISA flags."""
    return _compiler(target.cc, target.cflags, target.arch, backend_for(target).toolchain)


@cache
def _compiler(cc: str, cflags: tuple[str, ...], arch: str, toolchain: Toolchain) -> Compiler:
    command = shutil.which(cc)
    if command is None:
        package = CROSS_PACKAGES.get(arch, "gcc")
        raise ToolchainError(f"C compiler {cc!r} for {arch} targets is not installed; install "
                             f"it with `apt-get install {package}`")
    machine = _output([command, "-dumpmachine"]).strip()
    if not machine.startswith(arch):
        raise ToolchainError(f"C compiler {cc!r} builds for {machine}, not for {arch}")
    version = _output([command, "--version"]).splitlines()[0]
    return Compiler(command, toolchain.compile_flags + tuple(cflags), version, arch,
                    toolchain.link_flags, toolchain.libraries)


def _output(argv: Sequence[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise ToolchainError(f"cannot run {argv[0]}: {exc}") from exc


def build_timeout(source_bytes: int) -> float:
    """Seconds a build of `source_bytes` of C may take: $KILN_BUILD_TIMEOUT when set, else
    BUILD_BASE_S + BUILD_S_PER_KB per KiB."""
    configured = os.environ.get(BUILD_TIMEOUT_ENV, "").strip()
    if configured:
        try:
            seconds = float(configured)
        except ValueError:
            seconds = math.nan
        if not seconds > 0:
            raise KilnError(f"{BUILD_TIMEOUT_ENV} must be a positive number of seconds, "
                            f"got {configured!r}")
        return seconds
    return BUILD_BASE_S + BUILD_S_PER_KB * source_bytes / 1024


def default_build_cache() -> Path:
    return cache_dir() / "build"


@dataclass(frozen=True)
class _Unit:
    """A source whose object the cache lacks; `function` is set for a batchable kernel."""

    key: str
    name: str
    source: str
    function: str | None = None


class BuildCache:
    """Object files by key; counts what it compiled and what it found."""

    def __init__(self, root: Path | None = None):
        self.root = Path(root) if root is not None else default_build_cache()
        self.compiled = 0
        self.reused = 0

    def objects(self, compiler: Compiler, sources: Mapping[str, str],
                deadline: float | None = None,
                kernels: Mapping[str, str] | None = None) -> dict[str, Path]:
        """Object files for `sources` (name -> C source), compiling the missing ones in parallel;
        a compile still running at `deadline` (time.monotonic()) is killed (ToolchainError).

        `kernels` (name -> the global function its source defines) names the sources written
        to be concatenated into one file; the missing ones are compiled in batches."""
        kernels = kernels or {}
        keys = {name: compiler.key(source) for name, source in sources.items()}
        missing = {keys[name]: _Unit(keys[name], name, source, kernels.get(name))
                   for name, source in sources.items() if not self._path(keys[name]).is_file()}
        self.reused += len(set(keys.values())) - len(missing)
        linker = relocatable_linker(compiler.command)
        jobs = _jobs(list(missing.values()), os.cpu_count() or 1, linker is not None)

        def run(job: list[_Unit]) -> int:
            if len(job) == 1:
                return self._compile(compiler, job[0], deadline)
            return self._compile_batch(compiler, job, linker, deadline)

        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            for count in pool.map(run, jobs):
                self.compiled += count
        return {name: self._path(key) for name, key in keys.items()}

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.o"

    def _compile(self, compiler: Compiler, unit: _Unit, deadline: float | None = None) -> int:
        obj = self._path(unit.key)
        c_file = obj.with_suffix(".c")
        write_atomic(c_file, unit.source.encode())
        with temporary_beside(obj) as tmp:
            run_tool([compiler.command, *compiler.flags, "-c", str(c_file), "-o", str(tmp)],
                     f"compiling {unit.name}", deadline)
            os.replace(tmp, obj)
        return 1

    def _compile_batch(self, compiler: Compiler, units: Sequence[_Unit], linker: str,
                       deadline: float | None = None) -> int:
        """One translation unit of `units`, each kernel's object cut out of it; on a compile
        error each is compiled alone, so the error names the kernel."""
        self.root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".batch-", dir=self.root) as folder:
            c_file, batch = Path(folder) / "batch.c", Path(folder) / "batch.o"
            c_file.write_text("\n".join(u.source for u in units))
            try:
                run_tool([compiler.command, *compiler.flags, *BATCH_FLAGS, "-c", str(c_file),
                          "-o", str(batch)], f"compiling {_together(units)}", deadline)
            except ToolchainError:
                if deadline is not None and time.monotonic() >= deadline:
                    raise
                return sum(self._compile(compiler, u, deadline) for u in units)
            for unit in units:
                self._cut(unit, batch, linker, deadline)
        return len(units)

    def _cut(self, unit: _Unit, batch: Path, linker: str, deadline: float | None) -> None:
        obj = self._path(unit.key)
        write_atomic(obj.with_suffix(".c"), unit.source.encode())
        with temporary_beside(obj) as tmp:
            run_tool([linker, "-r", "--gc-sections", "-u", unit.function, str(batch),
                      "-o", str(tmp)], f"cutting {unit.name} out of its batch", deadline)
            os.replace(tmp, obj)


def _together(units: Sequence[_Unit], named: int = 3) -> str:
    names = ", ".join(u.name for u in units[:named])
    more = len(units) - named
    return f"{names} and {more} more together" if more > 0 else f"{names} together"


def _jobs(units: list[_Unit], cpus: int, can_batch: bool) -> list[list[_Unit]]:
    """The compiles for `units`, largest first: batches of small kernels, the rest alone."""
    small = [u for u in units if can_batch and u.function is not None
             and len(u.source) <= SOLO_BYTES and not NOINLINE.search(u.source)]
    batched = {u.key for u in small}
    jobs = [[u] for u in units if u.key not in batched] + _batches(small, cpus)
    return sorted(jobs, key=lambda job: -sum(len(u.source) for u in job))


def _batches(units: list[_Unit], cpus: int) -> list[list[_Unit]]:
    """`units` in at most `cpus` batches of at least BATCH_BYTES, balanced by size."""
    total = sum(len(u.source) for u in units)
    batches: list[list[_Unit]] = [[] for _ in range(max(1, min(cpus, total // BATCH_BYTES)))]
    sizes = [0] * len(batches)
    for unit in sorted(units, key=lambda u: (-len(u.source), u.key)):
        i = sizes.index(min(sizes))
        batches[i].append(unit)
        sizes[i] += len(unit.source)
    return [b for b in batches if b]


@cache
def relocatable_linker(command: str) -> str | None:
    """The linker `command` drives (the cross linker for a cross compiler), or None if it has
    none, when kernels are compiled one by one."""
    try:
        name = _output([command, "-print-prog-name=ld"]).strip()
    except ToolchainError:
        return None
    return shutil.which(name) if name else None


def link_shared(compiler: Compiler, objects: Sequence[Path], out: Path,
                deadline: float | None = None) -> None:
    run_tool([compiler.command, "-shared", *compiler.link_flags, "-Wl,-Bsymbolic",
              *map(str, objects), *compiler.libraries, "-o", str(out)],
             "linking the model library", deadline)


def link_executable(compiler: Compiler, objects: Sequence[Path], out: Path,
                    deadline: float | None = None, static: bool = True) -> None:
    """An executable, statically linked where `static` (it then runs on any device of the
    target's architecture; one that loads a driver library at run time cannot be static)."""
    run_tool([compiler.command, *(["-static"] if static else []), *compiler.link_flags,
              *map(str, objects),
              *compiler.libraries, "-o", str(out)],
             "linking the runner", deadline)


def run_tool(argv: Sequence[str], what: str, deadline: float | None = None) -> None:
    """Run a compiler or linker; one still running at `deadline` (time.monotonic()) is killed
    with the processes it started (gcc's cc1, as, ld) and a ToolchainError names `what`."""
    timeout = None if deadline is None else max(deadline - time.monotonic(), 0.001)
    try:
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, start_new_session=True)
    except OSError as exc:
        raise ToolchainError(f"{what}: cannot run {argv[0]}: {exc}") from exc
    try:
        _, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(process)
        raise ToolchainError(f"{what}: still running at the build's deadline, stopped (set "
                             f"{BUILD_TIMEOUT_ENV} to allow more seconds)") from None
    except BaseException:
        _kill_group(process)
        raise
    if process.returncode != 0:
        lines = stderr.strip().splitlines()[:STDERR_LINES]
        raise ToolchainError(f"{what} failed ({Path(argv[0]).name} exit status "
                             f"{process.returncode}):\n" + "\n".join(lines))


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.communicate()

