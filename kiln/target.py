"""Compilation targets: which machine the generated code runs on and how it is built."""
from __future__ import annotations

import platform
import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

from kiln.cpuinfo import host_cpuinfo
from kiln.errors import KilnError

# The names `kiln compile --help` lists; `cuda-sm<NN>` names any NVIDIA architecture (sm_75 and
# newer for the nvcc of the `nvidia-cuda-nvcc` package), `cuda` is `cuda-sm80`.
TARGET_NAMES = ("host", "x86_64", "aarch64", "opencl", "opencl-aarch64", "cuda", "cuda-sm90")
CUDA_DEFAULT_SM = 80
CUDA_NAME = re.compile(r"cuda(?:-sm_?(\d{2,3}))?")


@dataclass(frozen=True)
class DeviceLimits:
    """The facts of a target's device the planner's constraints come from (see
    `kiln.plan.dnnfusion.Constraints.for_target`)."""

    registers: int  # values a fused loop keeps without spilling: vector registers of a CPU, a
    # GPU work-item's share of the register file at full occupancy
    fast_memory_bytes: int  # a CPU core's L1 data cache; a GPU work-group's local memory
    shared_cache_bytes: int  # the L2 every row tile of a fused contraction re-reads from
    max_work_group: int = 1  # work-items one work-group (thread block) may have; 1 on a CPU


# AVX2's 16 ymm registers, a 32 KiB L1d and 1 MiB of L2 (the constants Kiln's CPU plans use).
CPU_LIMITS = DeviceLimits(registers=16, fast_memory_bytes=32 << 10, shared_cache_bytes=1 << 20)
# Mobile GPUs (Adreno 6xx/7xx, Mali Valhall): about 32 live 32-bit values per work-item before the
# compiler halves occupancy or spills, 32 KiB of local memory (OpenCL's minimum for a GPU, and
# what Mali and Adreno give), 512 KiB of L2 or more.
# Their work-groups take 256 work-items (Mali's maximum; Adreno's is 1024 for small kernels, less
# for register-hungry ones).
MOBILE_GPU_LIMITS = DeviceLimits(registers=32, fast_memory_bytes=32 << 10,
                                 shared_cache_bytes=512 << 10, max_work_group=256)
# NVIDIA sm_80 and later: 64K registers per SM shared by up to 2048 threads (32 each at full
# occupancy), 48 KiB of shared memory per block without opting in, an L2 of 40 MiB (A100) or more,
# 1024 threads per block.
CUDA_GPU_LIMITS = DeviceLimits(registers=32, fast_memory_bytes=48 << 10,
                               shared_cache_bytes=40 << 20, max_work_group=1024)


@dataclass(frozen=True)
class Target:
    name: str  # one of TARGET_NAMES
    arch: str  # "x86_64" or "aarch64"
    isa: tuple[str, ...]  # vector ISA features code may use: "avx512f", "avx2", "fma", "neon"
    cc: str  # C compiler command (of the host side, for a GPU backend)
    cflags: tuple[str, ...]  # ISA flags for that compiler
    backend: str = "c"  # the code generator's backend for it (kiln.codegen.backend.BACKENDS)
    gpu_arch: str = ""  # the GPU architecture the kernels are built for: "sm_80" (CUDA)
    limits: DeviceLimits = CPU_LIMITS

    @property
    def compute_capability(self) -> tuple[int, int] | None:
        """(major, minor) of a CUDA target's architecture: sm_86 -> (8, 6), sm_120 -> (12, 0)."""
        return sm_capability(self.gpu_arch) if self.gpu_arch else None

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
    cuda = CUDA_NAME.fullmatch(name)
    if cuda:
        return cuda_target(int(cuda.group(1) or CUDA_DEFAULT_SM))
    raise KilnError(f"unknown target {name!r}; choose one of {', '.join(TARGET_NAMES)} "
                    f"(or cuda-sm<NN> for another NVIDIA architecture)")


def cuda_target(sm: int) -> Target:
    """Kernels for NVIDIA GPUs of architecture sm_<sm>; the host side (the driver that launches
    them, the runner) is C for this machine's architecture, for any CPU of it."""
    arch = platform.machine()
    return Target(f"cuda-sm{sm}", arch, (), "gcc", (), backend="cuda", gpu_arch=f"sm_{sm}",
                  limits=CUDA_GPU_LIMITS)


def sm_capability(gpu_arch: str) -> tuple[int, int]:
    """"sm_86" (or "compute_86", "8.6") -> (8, 6): the last digit is the minor version."""
    digits = re.fullmatch(r"(?:sm_|compute_)?(\d+)(?:\.(\d+))?", gpu_arch.strip())
    if digits is None:
        raise KilnError(f"{gpu_arch!r} is not a CUDA architecture (sm_80, compute_90, 8.6)")
    if digits.group(2) is not None:
        return int(digits.group(1)), int(digits.group(2))
    number = int(digits.group(1))
    return number // 10, number % 10


def cuda_image_for(built: tuple[int, int], device: tuple[int, int]) -> str | None:
    """Which code of an artifact built for `built` a GPU of compute capability `device` runs:
    "cubin" (same major architecture, minor not newer: binary compatible), "ptx" (the PTX is not
    newer than the GPU: the driver compiles it), or None (the GPU is too old for it)."""
    if built[0] == device[0] and built[1] <= device[1]:
        return "cubin"
    if built <= device:
        return "ptx"
    return None


def runnable_targets(arch: str, isa: Iterable[str], runtimes: Iterable[str] = (),
                     gpu_capability: tuple[int, int] | None = None) -> tuple[str, ...]:
    """The named targets (all but "host") whose artifacts a device runs: those of its
    architecture whose ISA features it has and whose backend, unless it is C, is among the
    device's `runtimes` (the drivers it has: "opencl"); CUDA targets where its NVIDIA GPU of
    `gpu_capability` runs their code (`cuda_image_for`), its own architecture's included."""
    features, drivers = set(isa) | ({"neon"} if arch == "aarch64" else set()), set(runtimes)
    names = list(TARGET_NAMES[1:])
    if gpu_capability is not None:
        names.append(f"cuda-sm{gpu_capability[0]}{gpu_capability[1]}")
    found = []
    for name in dict.fromkeys(names):
        t = target(name)
        if t.arch != arch or not set(t.isa) <= features:
            continue
        if t.compute_capability is not None:
            if gpu_capability is not None and cuda_image_for(t.compute_capability, gpu_capability):
                found.append(name)
        elif t.runs_on_cpu or t.backend in drivers:
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
