"""Backends: how the IR of a kernel becomes code that runs on a kind of device.

The loop IR says *what* runs in parallel (`ir.Loop.parallel` with a grain) and where a GEMM
micro-kernel goes; a backend says *how*: its renderer prints the IR in its language (and maps
parallel loops: OpenMP pragmas, work-items, thread blocks), brings its GEMM micro-kernels, and
names its toolchain (compiler flags, source suffix) and the runner the artifact ships. A `Target`
(`kiln.target`) names its backend; nothing above code generation knows which one runs.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kiln.codegen.render.c import CRenderer
from kiln.codegen.render.cstyle import CStyleRenderer
from kiln.errors import KilnError
from kiln.target import Target


@dataclass(frozen=True)
class Toolchain:
    """How the runtime builds a backend's sources (`kiln.runtime.toolchain` runs it): flags for
    every compile (the target adds its ISA flags) and for linking the library and the runner."""

    source_suffix: str
    compile_flags: tuple[str, ...]
    link_flags: tuple[str, ...]
    libraries: tuple[str, ...]


@dataclass(frozen=True)
class Backend:
    name: str
    renderer: Callable[[], CStyleRenderer]  # a fresh renderer per kernel
    toolchain: Toolchain
    runner: str  # the runner's source among kiln.runtime's files: runs an artifact on a device


C_OPENMP = Backend(
    name="c",
    renderer=CRenderer,
    toolchain=Toolchain(
        source_suffix=".c",
        # -fno-math-errno: errno-free sqrt etc. vectorise
        compile_flags=("-O3", "-fopenmp", "-fPIC", "-fno-math-errno"),
        link_flags=("-fopenmp",),
        libraries=("-lm",),
    ),
    runner="runner.c",
)

BACKENDS: dict[str, Backend] = {backend.name: backend for backend in (C_OPENMP,)}


def backend_for(target: Target) -> Backend:
    found = BACKENDS.get(target.backend)
    if found is None:
        raise KilnError(f"target {target.name} names backend {target.backend!r}, which this Kiln "
                        f"does not have; it has {', '.join(sorted(BACKENDS))}")
    return found
