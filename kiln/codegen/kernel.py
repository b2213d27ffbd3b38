"""`Kernel`: one generated kernel, as the code generator hands it to the runtime (the kernel ABI
is described in `kiln.codegen`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Launch:
    """One device entry point of a kernel a GPU backend renders (`kiln.codegen.render.gpu`): the
    function `<Kernel.symbol><suffix>`, run on `work_items` work-items (threads) in a 1-D range,
    in work-groups (thread blocks) of `work_group` work-items that share local memory and
    barriers (`work_items` is a multiple of it), or of a size the host driver picks (0).
    The host launches a kernel's entry points in order, each after the previous one finished."""

    suffix: str
    work_items: int
    work_group: int = 0


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
    # A GPU backend's source defines device entry points instead of `symbol` (see Launch).
    launches: tuple[Launch, ...] = ()
