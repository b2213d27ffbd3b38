"""Memory plan: where every tensor a kernel touches lives while the model runs.

Regions:

- ``input`` / ``output``: the caller's buffers for the model's inputs and outputs, by position.
- ``weights``: one read-only blob holding every constant a kernel reads (graph constants and
  `Kernel.derived_constants`) and constant model outputs; identical contents are stored once.
- ``arena``: intermediate results (kernel outputs that are not model outputs). Each lives from
  the kernel that writes it to the last kernel that reads it; buffers are placed greedily by
  size, each at the best-fitting gap among the buffers whose lifetimes overlap its own, so
  space freed by dead tensors is reused.
- ``scratch``: one buffer of the largest `Kernel.scratch_bytes`, shared by all kernels.

View blocks (Reorganize ops only) run no kernel: their outputs are the same bytes as their root
tensor and share its location. A model output that is a view of a kernel's result gets that
result written straight into the output buffer; one that is a view of an input, a constant or
another output is copied after the kernels run.

Offsets are multiples of `ALIGNMENT`.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.codegen import Kernel
from kiln.ecg import Graph
from kiln.errors import KilnError
from kiln.placement import ALIGNMENT, ArenaBuffer, align, place
from kiln.plan import FusionPlan

REGIONS = ("input", "output", "weights", "arena", "scratch")


@dataclass(frozen=True)
class Ref:
    """A kernel argument's location: a region and an offset (a position for input/output)."""

    region: str
    where: int


@dataclass(frozen=True)
class WeightEntry:
    keys: tuple[str, ...]  # graph constant ids or "<kernel symbol>:<derived name>"
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class OutputCopy:
    """A model output no kernel writes in place: copied from `source` after the kernels run."""

    output: int
    source: Ref
    nbytes: int


@dataclass(frozen=True)
class MemoryPlan:
    kernel_order: tuple[int, ...]  # positions in the given kernel list, in execution order
    bindings: tuple[tuple[Ref, ...], ...]  # per executed kernel, one Ref per argument
    arena: tuple[ArenaBuffer, ...]
    weights: tuple[WeightEntry, ...]
    copies: tuple[OutputCopy, ...]
    arena_bytes: int
    weights_bytes: int
    scratch_bytes: int
    io_bytes: int

    @property
    def peak_bytes(self) -> int:
        return self.arena_bytes + self.weights_bytes + self.scratch_bytes + self.io_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "arena_bytes": self.arena_bytes, "weights_bytes": self.weights_bytes,
            "scratch_bytes": self.scratch_bytes, "io_bytes": self.io_bytes,
            "peak_bytes": self.peak_bytes, "alignment": ALIGNMENT,
            "arena": [vars(b) for b in self.arena],
            "weights": [{"keys": list(w.keys), "offset": w.offset, "nbytes": w.nbytes,
                         "dtype": w.dtype, "shape": list(w.shape)} for w in self.weights],
            "output_copies": [{"output": c.output, "region": c.source.region,
                               "where": c.source.where, "nbytes": c.nbytes} for c in self.copies],
        }


def plan_memory(plan: FusionPlan, kernels: Sequence[Kernel]) -> MemoryPlan:
    """Place every tensor the kernels use; kernels run in the plan's block order."""
    graph = plan.graph
    roots = view_roots(plan)
    views = {b.id for b in plan.blocks if b.is_view}
    order = [i for i in execution_order(plan, kernels) if kernels[i].block_id not in views]
    ordered = [kernels[i] for i in order]
    constants = _constants(graph, ordered, roots)
    weights, weight_at = _pack_weights(constants)
    fixed = _fixed_refs(graph, roots, ordered)
    intervals = _lifetimes(graph, ordered, set(constants), roots, set(fixed))
    arena = place(intervals)
    refs = fixed | {b.tensor: Ref("arena", b.offset) for b in arena}
    refs |= {key: Ref("weights", off) for key, off in weight_at.items()}
    bindings = tuple(tuple(refs[_arg_key(k, a, roots)] for a in k.args) for k in ordered)
    arena_bytes = max((align(b.offset + b.nbytes) for b in arena), default=0)
    return MemoryPlan(
        kernel_order=tuple(order), bindings=bindings, arena=tuple(arena), weights=weights,
        copies=_output_copies(graph, roots, refs, ordered),
        arena_bytes=arena_bytes, weights_bytes=_blob_size(weights),
        scratch_bytes=align(max((k.scratch_bytes for k in ordered), default=0)),
        io_bytes=sum(graph.tensors[t].nbytes for t in (*graph.inputs, *graph.outputs)))


def view_roots(plan: FusionPlan) -> dict[str, str]:
    """For every output of a view block, the tensor whose bytes it is."""
    roots: dict[str, str] = {}
    for block in plan.blocks:
        if block.is_view:
            for op_id in block.op_ids:
                op = plan.graph.op_by_id[op_id]
                source = op.inputs[0]
                roots.update((t, roots.get(source, source)) for t in op.outputs)
    return roots


def execution_order(plan: FusionPlan, kernels: Sequence[Kernel]) -> list[int]:
    """Kernel positions sorted by their block's position (stable within a block)."""
    position = {b.id: i for i, b in enumerate(plan.blocks)}
    unknown = sorted({k.block_id for k in kernels} - set(position))
    if unknown:
        raise KilnError(f"kernels refer to blocks not in the plan: {', '.join(unknown)}")
    return sorted(range(len(kernels)), key=lambda i: position[kernels[i].block_id])


def weights_blob(plan: FusionPlan, kernels: Sequence[Kernel], memory: MemoryPlan) -> bytes:
    """The bytes of the weights region laid out as `memory.weights` says."""
    ordered = [kernels[i] for i in memory.kernel_order]
    constants = _constants(plan.graph, ordered, view_roots(plan))
    blob = bytearray(memory.weights_bytes)
    for entry in memory.weights:
        data = np.ascontiguousarray(constants[entry.keys[0]]).tobytes()
        blob[entry.offset:entry.offset + entry.nbytes] = data
    return bytes(blob)


def _arg_key(kernel: Kernel, arg: str, roots: dict[str, str]) -> str:
    return f"{kernel.symbol}:{arg}" if arg in kernel.derived_constants else roots.get(arg, arg)


def _constants(graph: Graph, kernels: Sequence[Kernel],
               roots: dict[str, str]) -> dict[str, np.ndarray]:
    """Every constant the kernels read, plus constant model outputs, by weight key."""
    found: dict[str, np.ndarray] = {}
    for k in kernels:
        for arg in k.args:
            key = _arg_key(k, arg, roots)
            if arg in k.derived_constants:
                found[key] = np.asarray(k.derived_constants[arg])
            elif arg not in graph.tensors:
                raise KilnError(f"kernel {k.symbol} reads {arg!r}, which is neither a tensor of "
                                f"the graph nor one of its derived constants")
            elif graph.tensors[key].is_constant:
                found[key] = graph.tensors[key].data
    for t in graph.outputs:
        root = roots.get(t, t)
        if graph.tensors[root].is_constant:
            found[root] = graph.tensors[root].data
    return found


def _pack_weights(constants: dict[str, np.ndarray]) -> tuple[tuple[WeightEntry, ...], dict[str, int]]:
    by_content: dict[str, list[str]] = {}
    for key, data in constants.items():
        by_content.setdefault(_content_hash(data), []).append(key)
    entries, offset_of, offset = [], {}, 0
    for keys in by_content.values():
        data = constants[keys[0]]
        entries.append(WeightEntry(tuple(keys), offset, data.nbytes, data.dtype.name, data.shape))
        offset_of.update((k, offset) for k in keys)
        offset = align(offset + data.nbytes)
    return tuple(entries), offset_of


def _content_hash(data: np.ndarray) -> str:
    digest = hashlib.sha256(f"{data.dtype.str}{data.shape}".encode())
    digest.update(np.ascontiguousarray(data).tobytes())
    return digest.hexdigest()


def _blob_size(weights: Sequence[WeightEntry]) -> int:
    return max((align(w.offset + w.nbytes) for w in weights), default=0)


def _fixed_refs(graph: Graph, roots: dict[str, str], kernels: Sequence[Kernel]) -> dict[str, Ref]:
    """Model inputs and model outputs (the first position of an output listed twice); a kernel
    result whose view is a model output is written into that output's buffer."""
    written = {t for k in kernels for t in k.outputs}
    refs: dict[str, Ref] = {}
    for i, t in enumerate(graph.outputs):
        refs.setdefault(t, Ref("output", i))
    for i, t in enumerate(graph.outputs):
        root = roots.get(t, t)
        if root != t and root in written and root not in refs:
            refs[root] = Ref("output", i)
    refs.update((t, Ref("input", i)) for i, t in enumerate(graph.inputs))
    return refs


def _lifetimes(graph: Graph, kernels: Sequence[Kernel], constants: set[str],
               roots: dict[str, str], fixed: set[str]) -> list[tuple[str, int, int, int]]:
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, k in enumerate(kernels):
        for arg in k.args:
            key = _arg_key(k, arg, roots)
            if key in constants or key in fixed:
                continue
            if arg in k.outputs:
                if key in first:
                    raise KilnError(f"tensor {key} is written by two kernels "
                                    f"({kernels[first[key]].symbol} and {k.symbol})")
                first[key] = i
            elif key not in first:
                raise KilnError(f"kernel {k.symbol} reads {key} before any kernel writes it")
            last[key] = max(last.get(key, i), i)
    return [(t, graph.tensors[t].nbytes, i, last.get(t, i)) for t, i in first.items()]


def _output_copies(graph: Graph, roots: dict[str, str], refs: dict[str, Ref],
                   kernels: Sequence[Kernel]) -> tuple[OutputCopy, ...]:
    """Outputs whose bytes are elsewhere when the kernels are done: copied there afterwards."""
    written = {t for k in kernels for t in k.outputs}
    copies = []
    for i, t in enumerate(graph.outputs):
        root = roots.get(t, t)
        source = refs.get(root)
        if source is None or (source.region in ("arena", "output") and root not in written):
            raise KilnError(f"model output {graph.tensors[t].source_name or t!r} ({t}) is "
                            f"written by no kernel")
        if source != Ref("output", i):
            copies.append(OutputCopy(i, source, graph.tensors[t].nbytes))
    return tuple(copies)
