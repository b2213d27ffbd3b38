"""Backends: how the IR of a kernel becomes code that runs on a kind of device.

The loop IR says *what* runs in parallel (`ir.Loop.parallel` with a grain) and where a GEMM
micro-kernel goes; a backend says *how*: its renderer prints the IR in its language (and maps
parallel loops: calls into the C thread pool, work-items, thread blocks), brings its GEMM
micro-kernels, and names its toolchain (compiler flags, source suffix) and the runner the artifact
ships. A `Target` (`kiln.target`) names its backend; nothing above code generation knows which one
runs.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kiln.codegen.render.c import CRenderer
from kiln.codegen.render.cstyle import CStyleRenderer
from kiln.codegen.render.cuda import CudaRenderer
from kiln.codegen.render.gpu import GPU_SCHEDULE
from kiln.codegen.render.opencl import OpenCLRenderer
from kiln.codegen.schedule import DEFAULT_SCHEDULE, Schedule
from kiln.errors import KilnError
from kiln.target import Target


@dataclass(frozen=True)
class Toolchain:
    """How the runtime builds a backend's sources (`kiln.runtime.toolchain` runs it): flags for
    every compile of host C (the target adds its ISA flags) and for linking the library and the
    runner. `static_runner`: the runner is linked statically (it runs on any device of the
    architecture); a runner that loads a device's driver library at run time is linked
    dynamically, since a static program cannot load one."""

    source_suffix: str  # of the kernel sources
    compile_flags: tuple[str, ...]
    link_flags: tuple[str, ...]
    libraries: tuple[str, ...]
    static_runner: bool = True


@dataclass(frozen=True)
class Backend:
    name: str
    renderer: Callable[[], CStyleRenderer]  # a fresh renderer per kernel
    toolchain: Toolchain
    runner: str  # the runner's source among kiln.runtime's files: runs an artifact on a device
    # The host side (kiln.runtime's drivers): "c" calls the kernels as C functions; "opencl"
    # builds the kernel sources into an OpenCL program at run time and launches them.
    driver: str = "c"
    schedule: Schedule = DEFAULT_SCHEDULE  # the schedule parameters' defaults for its devices
    # GEMMs in work-groups sized from the target's `DeviceLimits` (`Schedule.for_device`)
    work_groups: bool = False


C_OPENMP = Backend(
    name="c",
    renderer=CRenderer,
    toolchain=Toolchain(
        source_suffix=".c",
        # -fno-math-errno: errno-free sqrt etc. vectorise; OpenMP only for its `simd` loops
        compile_flags=("-O3", "-fopenmp-simd", "-pthread", "-fPIC", "-fno-math-errno"),
        link_flags=("-pthread",),
        libraries=("-lm",),
    ),
    runner="runner.c",
)

OPENCL = Backend(
    name="opencl",
    renderer=OpenCLRenderer,
    toolchain=Toolchain(
        source_suffix=".cl",
        compile_flags=("-O2", "-fPIC"),  # the host driver; the device compiles the kernels
        link_flags=(),
        libraries=("-ldl",),  # libOpenCL.so is opened at run time, never linked
        static_runner=False,
    ),
    runner="runner.c",
    driver="opencl",
    schedule=GPU_SCHEDULE,
    work_groups=True,
)

CUDA = Backend(
    name="cuda",
    renderer=CudaRenderer,
    toolchain=Toolchain(
        source_suffix=".cu",  # nvcc builds them into cubin and PTX (kiln.runtime.nvcc)
        compile_flags=("-O2", "-fPIC"),  # the host driver
        link_flags=(),
        libraries=("-ldl",),  # libcuda.so.1 is opened at run time, never linked
        static_runner=False,
    ),
    runner="runner.c",
    driver="cuda",
    schedule=GPU_SCHEDULE,
    work_groups=True,
)

BACKENDS: dict[str, Backend] = {backend.name: backend for backend in (C_OPENMP, OPENCL, CUDA)}


def backend_for(target: Target) -> Backend:
    found = BACKENDS.get(target.backend)
    if found is None:
        raise KilnError(f"target {target.name} names backend {target.backend!r}, which this Kiln "
                        f"does not have; it has {', '.join(sorted(BACKENDS))}")
    return found
