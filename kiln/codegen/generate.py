"""`generate`: a FusionPlan → one C kernel per block; `supported_ops` and `check_supported`.

The code generator, as a list of steps per block:

1. `lower.BlockLowering` walks the block's data-flow tree (DNNFusion §4.4.1) and builds loop-nest
   IR (`ir`): anchor stages (MatMul, Conv, pooling, ... with fused prologue and epilogue), row
   stages (reductions and normalisations sharing rows, multi-phase), elementwise stages; every
   other tensor is an inline expression (`expr`) composed through per-op index maps (`indexing`,
   `ops/*`), so data movement inside a block is never a copy (§4.4.2).
2. `passes.finish_stage` splits inner loops whose index maps divide them (strength reduction)
   and picks the parallel loops, following the `schedule.Schedule` parameters.
3. `passes.bind_values` names common sub-expressions, one temporary each at the outermost loop
   where it is invariant.
4. The target's backend (`backend.backend_for`) renders the kernel: C with OpenMP, or OpenCL C
   (device entry points with their launches, `render/gpu.py`).

Kernels use Kiln's identifiers only (tensor ids, k<i>_ symbols): no model name reaches a source.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from kiln.codegen.backend import Backend, backend_for
from kiln.codegen.expr import DTYPES
from kiln.codegen.kernel import Kernel
from kiln.codegen.lower import BlockLowering
from kiln.codegen.ops import registered
from kiln.codegen.passes import bind_values
from kiln.codegen.schedule import Schedule
from kiln.codegen.tiled import lower_tiled
from kiln.ecg import Graph
from kiln.errors import UnsupportedOpsError
from kiln.ops import known_ops
from kiln.plan import Block, FusionPlan
from kiln.target import Target

# Ops the frontend always resolves before code generation (static shapes make them constants).
RESOLVED_BY_FRONTEND = frozenset(name for name, info in known_ops().items() if info.static_value)


def supported_ops() -> frozenset[str]:
    """Op types a compiled model may contain: those the code generator lowers (with every
    attribute their ONNX definition has) and those the frontend folds into constants."""
    return frozenset(registered()) | RESOLVED_BY_FRONTEND


def check_supported(graph: Graph) -> None:
    """Raise UnsupportedOpsError listing every op the code generator cannot lower, by op type
    with the ops' source names: unknown op types, unsupported element types, unsupported
    attribute values."""
    found: dict[str, list[str]] = {}
    lowerings = registered()
    for op in graph.ops:
        lw = lowerings.get(op.op_type)
        reason = None
        if lw is None:
            reason = "no lowering"
        else:
            dtypes = {graph.tensors[t].dtype for t in (*op.present_inputs(), *op.outputs)}
            if not dtypes <= DTYPES:
                reason = f"element type {', '.join(sorted(dtypes - DTYPES))}"
            elif lw.check is not None:
                reason = lw.check(op, graph)
        if reason is not None:
            found.setdefault(op.op_type, []).append(op.source_name or op.id)
    if found:
        raise UnsupportedOpsError(found)


def generate(plan: FusionPlan, target: Target, schedule: Schedule | None = None,
             block_schedules: Mapping[str, Mapping[str, Any]] | None = None) -> list[Kernel]:
    """One Kernel per block of the plan, in plan order (the kernel ABI of `kiln.codegen`). A
    block's schedule is `schedule` (by default the target backend's) with the plan's overrides for
    it (`FusionPlan.schedules`), then `block_schedules`' (the tuner's) on top."""
    check_supported(plan.graph)
    backend = backend_for(target)
    schedule = schedule or backend.schedule
    block_schedules = block_schedules or {}
    return [_kernel(plan.graph, block, i, target, backend,
                    _for_target(schedule.merged(plan.schedules.get(block.id))
                                .merged(block_schedules.get(block.id)), target, backend),
                    plan.stages.get(block.id))
            for i, block in enumerate(plan.blocks)]


def _for_target(schedule: Schedule, target: Target, backend: Backend) -> Schedule:
    """The schedule's target-dependent parameters made explicit: work-group tiling from the
    device's limits (GPU backends), the micro-kernel's shape and vector width from the ISA."""
    if backend.work_groups:
        schedule = schedule.for_device(target.limits)
    return schedule.for_isa(target.isa)


def kernel_symbol(block: Block, index: int) -> str:
    return f"k{index}_{re.sub(r'[^0-9A-Za-z_]', '_', block.name)}"


def _kernel(graph: Graph, block: Block, index: int, target: Target, backend: Backend,
            schedule: Schedule, stage: Any = None) -> Kernel:
    symbol = kernel_symbol(block, index)
    lowered = (lower_tiled(graph, block, symbol, schedule, stage)
               or BlockLowering(graph, block, symbol, schedule).lower())
    bind_values(lowered.kernel)
    renderer = backend.renderer()
    source = renderer.kernel(lowered.kernel, f"Kiln kernel {symbol} (block {block.id}, "
                                             f"target {target.name})")
    record = {"target": target.name, "arch": target.arch, **schedule.as_dict(),
              "stitch_type": schedule.stitch_type, "stages": lowered.stage_info}
    return Kernel(symbol=symbol, block_id=block.id, source=source,
                  args=tuple(lowered.inputs + lowered.outputs), outputs=tuple(lowered.outputs),
                  derived_constants=lowered.derived, schedule=record,
                  scratch_bytes=lowered.kernel.scratch_bytes, launches=renderer.launches)
