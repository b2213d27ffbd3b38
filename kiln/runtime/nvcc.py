"""Building CUDA kernels with nvcc (from the `nvidia-cuda-nvcc` pip package: `pip install
'kiln[cuda]'`; it runs without a GPU) into cubin for the target's architecture plus its PTX.

    images = build_images(program, "sm_80", deadline)   # CudaImages(cubin=..., ptx=...)

The two are built side by side by two nvcc runs and cached by content hash like the C objects
(`<cache>/build/<key[:2]>/<key>.cubin` and `.ptx`, key = SHA-256 of the source, nvcc's version,
the architecture and the flags), so a model seen before is never compiled again.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from kiln.files import temporary_beside, write_atomic
from kiln.runtime.toolchain import ToolchainError, default_build_cache, run_tool

NVCC_ENV = "KILN_NVCC"
# -diag-suppress: declarations of buffers an entry point does not use (every entry point of a
# kernel declares them all), and variables set but not read.
FLAGS = ("-O3", "-std=c++17", "-diag-suppress", "177,550")


@dataclass(frozen=True)
class CudaImages:
    gpu_arch: str  # "sm_80"
    cubin: bytes
    ptx: bytes

    @property
    def names(self) -> tuple[str, str]:
        """The artifact member names of the cubin and the PTX."""
        number = self.gpu_arch.removeprefix("sm_")
        return f"lib/kernels.sm_{number}.cubin", f"lib/kernels.compute_{number}.ptx"


def find_nvcc() -> str:
    """$KILN_NVCC, nvcc of the `nvidia-cuda-nvcc` package, or nvcc on the PATH."""
    configured = os.environ.get(NVCC_ENV, "").strip()
    if configured:
        return configured
    try:
        import nvidia  # the namespace package of NVIDIA's pip wheels
        for root in nvidia.__path__:
            found = sorted(Path(root).glob("*/bin/nvcc"), reverse=True)  # cu13 before cu12
            if found:
                return str(found[0])
    except ImportError:
        pass
    on_path = shutil.which("nvcc")
    if on_path:
        return on_path
    raise ToolchainError("nvcc is not installed: building CUDA kernels needs it; install it with "
                         "`pip install 'kiln[cuda]'` (the nvidia-cuda-nvcc package, no GPU "
                         f"needed) or set {NVCC_ENV} to an nvcc")


@cache
def _nvcc_facts(nvcc: str) -> tuple[str, tuple[str, ...]]:
    """(version line, the real architectures it builds for)."""
    try:
        version = subprocess.run([nvcc, "--version"], capture_output=True, text=True,
                                 check=True).stdout.strip().splitlines()[-1]
        codes = subprocess.run([nvcc, "--list-gpu-code"], capture_output=True, text=True,
                               check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError) as exc:
        raise ToolchainError(f"cannot run {nvcc}: {exc}") from exc
    return version, tuple(codes)


def build_images(program: str, gpu_arch: str, deadline: float | None = None,
                 root: Path | None = None) -> CudaImages:
    """cubin for `gpu_arch` and PTX of the same architecture for the CUDA C++ `program`."""
    nvcc = find_nvcc()
    version, codes = _nvcc_facts(nvcc)
    if gpu_arch not in codes:
        raise ToolchainError(f"nvcc ({version}) cannot build for {gpu_arch}; it builds for "
                             f"{', '.join(codes)}")
    number = gpu_arch.removeprefix("sm_")
    key = hashlib.sha256(json.dumps([program, version, gpu_arch, FLAGS]).encode()).hexdigest()
    folder = (root or default_build_cache()) / key[:2]
    source = folder / f"{key}.cu"
    outputs = {"cubin": (folder / f"{key}.cubin", [f"-arch={gpu_arch}", "-cubin"]),
               "ptx": (folder / f"{key}.ptx", [f"-arch=compute_{number}", "-ptx"])}
    missing = {kind: v for kind, v in outputs.items() if not v[0].is_file()}
    if missing:
        write_atomic(source, program.encode())

        def build(kind: str) -> None:
            path, flags = missing[kind]
            with temporary_beside(path) as tmp:
                run_tool([nvcc, *FLAGS, *flags, str(source), "-o", str(tmp)],
                         f"compiling the CUDA kernels ({kind} for {gpu_arch})", deadline)
                os.replace(tmp, path)

        with ThreadPoolExecutor(max_workers=2) as pool:
            list(pool.map(build, missing))
    return CudaImages(gpu_arch, outputs["cubin"][0].read_bytes(), outputs["ptx"][0].read_bytes())
