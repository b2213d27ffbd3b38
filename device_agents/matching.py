"""Which GPU devices run which CUDA artifacts (the agent checks before it runs one, the service
before it hands a task out, the workers when they pick a device class to measure or tune on).

A CUDA artifact holds cubin for its architecture plus its PTX (kiln.target.cuda_image_for): a GPU
runs it when the cubin has the GPU's major architecture and a minor one not newer, or when the
PTX is not newer than the GPU. A GPU's compute capability comes from its facts (`nvidia-smi
--query-gpu=compute_cap`). The service compares capabilities as numbers: major * 100 + minor.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kiln.errors import KilnError
from kiln.target import cuda_image_for, sm_capability


def capability_number(capability: tuple[int, int]) -> int:
    """(8, 6) -> 806: ordered like the capabilities themselves."""
    return capability[0] * 100 + capability[1]


def gpu_arch_number(gpu_arch: str) -> int | None:
    """The number of an artifact's GPU architecture ("sm_80" -> 800); None for no GPU."""
    return capability_number(sm_capability(gpu_arch)) if gpu_arch else None


def device_capability(facts: Any) -> tuple[int, int] | None:
    """A device's GPU compute capability from its facts (HardwareFacts or their JSON)."""
    value = facts.get("gpu_compute_capability") if isinstance(facts, Mapping) else \
        getattr(facts, "gpu_compute_capability", None)
    if not value:
        return None
    try:
        return sm_capability(str(value))
    except KilnError:
        return None


def gpu_mismatch(gpu_arch: str, facts: Any, device: str) -> str | None:
    """Why `device` cannot run kernels built for `gpu_arch` ("sm_80"); None when it can."""
    if not gpu_arch:
        return None
    built = sm_capability(gpu_arch)
    found = device_capability(facts)
    if found is None:
        return (f"the artifact's kernels are CUDA for {gpu_arch}, and {device} reports no NVIDIA "
                f"GPU (nvidia-smi --query-gpu=compute_cap)")
    if cuda_image_for(built, found) is None:
        return (f"the artifact's kernels are built for {gpu_arch} (compute capability "
                f"{built[0]}.{built[1]}); {device}'s GPU has {found[0]}.{found[1]}, which runs "
                f"neither its cubin (another major architecture) nor its PTX (newer than the GPU)")
    return None
