"""Compilation targets: which machine the generated code runs on and how it is built."""
from __future__ import annotations

import platform
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

from kiln.cpuinfo import host_cpuinfo
from kiln.errors import KilnError

TARGET_NAMES = ("host", "x86_64", "aarch64", "opencl", "opencl-aarch64")


@dataclass(frozen=True)
class DeviceLimits:
    """The facts of a target's device the planner's constraints come from (see
    `kiln.plan.dnnfusion.Constraints.for_target`)."""

    registers: int  # values a fused loop keeps without spilling: vector registers of a CPU, a
    # GPU work-item's share of the register file at full occupancy
    fast_memory_bytes: int  # a CPU core's L1 data cache; a GPU work-group's local memory
    shared_cache_bytes: int  # the L2 every row tile of a fused contraction re-reads from


# AVX2's 16 ymm registers, a 32 KiB L1d and 1 MiB of L2 (the constants Kiln's CPU plans use).
CPU_LIMITS = DeviceLimits(registers=16, fast_memory_bytes=32 << 10, shared_cache_bytes=1 << 20)
# Mobile GPUs (Adreno 6xx/7xx, Mali Valhall): about 32 live 32-bit values per work-item before the
# compiler halves occupancy or spills, 32 KiB of local memory (OpenCL's minimum for a GPU, and
# what Mali and Adreno give), 512 KiB of L2 or more.
MOBILE_GPU_LIMITS = DeviceLimits(registers=32, fast_memory_bytes=32 << 10,
                                 shared_cache_bytes=512 << 10)


@dataclass(frozen=True)
class Target:
    name: str  # one of TARGET_NAMES
    arch: str  # "x86_64" or "aarch64"
    isa: tuple[str, ...]  # vector ISA features code may use: "avx512f", "avx2", "fma", "neon"
    cc: str  # C compiler command (of the host side, for a GPU backend)
    cflags: tuple[str, ...]  # ISA flags for that compiler
    backend: str = "c"  # the code generator's backend for it (kiln.codegen.backend.BACKENDS)
    limits: DeviceLimits = CPU_LIMITS

    @property
    def runs_on_cpu(self) -> bool:
        """Whether the kernels run on the CPU (as C functions), not on a device (a GPU's)."""
        return self.backend == "c"

    @property
    def vector_bytes(self) -> int:
        if "avx512f" in self.isa:
            return 64
        if "avx2" in self.isa:
            return 32
        return 16  # SSE / NEON

    @property
    def is_native(self) -> bool:
        return self.arch == platform.machine()


def target(name: str) -> Target:
    if name == "host":
        return host_target()
    if name == "x86_64":
        return Target("x86_64", "x86_64", ("avx2", "fma"), "gcc", ("-mavx2", "-mfma"))
    if name == "aarch64":
        cc = "gcc" if platform.machine() == "aarch64" else "aarch64-linux-gnu-gcc"
        return Target("aarch64", "aarch64", ("neon",), cc, ("-march=armv8-a",))
    if name == "opencl":  # an x86-64 host with an OpenCL driver (a GPU's, or PoCL on the CPU)
        return Target("opencl", "x86_64", (), "gcc", (), backend="opencl",
                      limits=MOBILE_GPU_LIMITS)
    if name == "opencl-aarch64":  # a phone or board whose GPU has an OpenCL driver
        cc = "gcc" if platform.machine() == "aarch64" else "aarch64-linux-gnu-gcc"
        return Target("opencl-aarch64", "aarch64", (), cc, ("-march=armv8-a",), backend="opencl",
                      limits=MOBILE_GPU_LIMITS)
    raise KilnError(f"unknown target {name!r}; choose one of {', '.join(TARGET_NAMES)}")


def runnable_targets(arch: str, isa: Iterable[str], runtimes: Iterable[str] = ()) -> tuple[str, ...]:
    """The named targets (all but "host") whose artifacts a device runs: those of its
    architecture whose ISA features it has and whose backend, unless it is C, is among the
    device's `runtimes` (the drivers it has: "opencl")."""
    features, drivers = set(isa) | ({"neon"} if arch == "aarch64" else set()), set(runtimes)
    found = []
    for name in TARGET_NAMES[1:]:
        t = target(name)
        if t.arch == arch and set(t.isa) <= features and (t.runs_on_cpu or t.backend in drivers):
            found.append(name)
    return tuple(found)


@lru_cache(maxsize=1)
def host_target() -> Target:
    arch = platform.machine()
    flags = set(host_cpuinfo()["flags"])
    if arch == "aarch64":
        return Target("host", arch, ("neon",), "gcc", ("-mcpu=native",))
    isa = tuple(f for f in ("avx512f", "avx2", "fma") if f in flags)
    return Target("host", arch, isa, "gcc", ("-march=native",))
