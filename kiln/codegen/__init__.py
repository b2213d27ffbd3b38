"""Code generation: each block of a fusion plan becomes one C function (the kernel ABI below).

Kernel ABI, shared by the code generator and the runtime that calls the kernels:

    void <Kernel.symbol>(void *const *args);

`args[i]` points to the buffer of tensor `Kernel.args[i]` (dense, row-major, the tensor's dtype).
The args are the block's inputs the kernel reads (activations, weights, and derived constants it
asked for), then the block's outputs it writes; when `scratch_bytes` > 0, one more pointer to that
many bytes of 64-byte-aligned scratch memory follows (the runtime owns it and may reuse it between
kernels). Kernels may use OpenMP; the runtime sets the thread count. A kernel never allocates,
never keeps state between calls and never writes its inputs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Kernel:
    symbol: str  # C identifier, unique within a model, e.g. k3_fused_matmul_add_gelu
    block_id: str
    source: str  # C source defining `void symbol(void *const *args)` (and static helpers)
    args: tuple[str, ...]  # tensor ids: inputs first, then outputs
    outputs: tuple[str, ...]  # the ids among `args` the kernel writes
    derived_constants: dict[str, np.ndarray] = field(default_factory=dict)  # e.g. packed weights
    schedule: dict[str, Any] = field(default_factory=dict)  # parameters the source was made with
    scratch_bytes: int = 0


from kiln.codegen.generate import check_supported as check_supported
from kiln.codegen.generate import generate as generate
from kiln.codegen.generate import supported_ops as supported_ops
