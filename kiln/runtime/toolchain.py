"""Compiling and linking generated sources for a target with its backend's toolchain, with objects cached by content hash.

An object's key is the SHA-256 of (source, compiler command, flags, `compiler --version`); it
is stored as `<cache>/<key[:2]>/<key>.o` next to its source, both written through a temporary
file and a rename, so a kernel seen before — in this model or any earlier one — is never
compiled again, and concurrent builds never see half-written files.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
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


class BuildCache:
    """Object files by key; counts what it compiled and what it found."""

    def __init__(self, root: Path | None = None):
        self.root = Path(root) if root is not None else default_build_cache()
        self.compiled = 0
        self.reused = 0

    def objects(self, compiler: Compiler, sources: Mapping[str, str],
                deadline: float | None = None) -> dict[str, Path]:
        """Object files for `sources` (name -> C source), compiling the missing ones in parallel;
        a compile still running at `deadline` (time.monotonic()) is killed (ToolchainError)."""
        keys = {name: compiler.key(source) for name, source in sources.items()}
        missing = {keys[name]: (name, source) for name, source in sources.items()
                   if not self._path(keys[name]).is_file()}
        self.reused += len(set(keys.values())) - len(missing)
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            for _ in pool.map(lambda item: self._compile(compiler, item[0], *item[1], deadline),
                              missing.items()):
                self.compiled += 1
        return {name: self._path(key) for name, key in keys.items()}

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.o"

    def _compile(self, compiler: Compiler, key: str, name: str, source: str,
                 deadline: float | None = None) -> None:
        obj = self._path(key)
        c_file = obj.with_suffix(".c")
        write_atomic(c_file, source.encode())
        with temporary_beside(obj) as tmp:
            run_tool([compiler.command, *compiler.flags, "-c", str(c_file), "-o", str(tmp)],
                     f"compiling {name}", deadline)
            os.replace(tmp, obj)


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

