"""This machine's NVIDIA GPU, asked through the CUDA driver library (libcuda.so.1) when it is there.

Kiln needs no GPU to build CUDA artifacts; this tells whether one is here (the tests of what a
machine without one says skip on a machine with one). The answer is the first GPU's compute
capability, or None when the driver library is missing or finds no GPU.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache

DRIVER_LIBRARY = "libcuda.so.1"
ATTRIBUTE_MAJOR, ATTRIBUTE_MINOR = 75, 76  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR / MINOR


@lru_cache(maxsize=1)
def gpu_capability() -> tuple[int, int] | None:
    """(major, minor) of this machine's first CUDA GPU; None without a driver or a GPU."""
    try:
        cuda = ctypes.CDLL(DRIVER_LIBRARY)
    except OSError:
        return None
    count, device = ctypes.c_int(0), ctypes.c_int(0)
    major, minor = ctypes.c_int(0), ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value < 1:
        return None
    if (cuda.cuDeviceGet(ctypes.byref(device), 0) != 0
            or cuda.cuDeviceGetAttribute(ctypes.byref(major), ATTRIBUTE_MAJOR, device) != 0
            or cuda.cuDeviceGetAttribute(ctypes.byref(minor), ATTRIBUTE_MINOR, device) != 0):
        return None
    return major.value, minor.value

