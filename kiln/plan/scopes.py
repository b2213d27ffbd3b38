"""GraphTurbo's buffer scopes (§3.4) and memory allocation with reuse and spilling (§4.3), and the
row windows a stage's instances compute (the halo rows a 3×3 convolution needs).

A stage (a block) that runs tile by tile computes, per instance, a window of rows of each tensor
it keeps: the rows its consumers in the stage need, plus the instance's own rows of a tensor the
stage must store. Windows are affine in the instance number: instance i needs rows
[i·step + lo, i·step + hi), clipped to the tensor; the generated kernel shifts a window that
would cross an edge back inside the tensor, so every window has the same static height.

Scopes on a CPU (the DSA's buffers mapped as in `kiln.plan.graphturbo`): "register" (a value the
kernel computes inside an expression, never stored), "L1", "L2" (a window buffer of one
instance, private to the core running it), "memory" (a full tensor: a kernel's output in the
arena of the memory plan, or a buffer spilled from a full scope).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from kiln.ecg import Graph, Op
from kiln.mapping import MappingType

SCOPES = ("register", "L1", "L2", "memory")
ALIGN = 64
ROW_DIM = 2  # the rows of an NCHW tensor


@dataclass(frozen=True)
class Rows:
    """Rows [i·step + lo, i·step + hi) of a tensor for instance i."""

    step: int
    lo: int
    hi: int

    def union(self, other: Rows) -> Rows | None:
        if self.step != other.step:
            return None
        return Rows(self.step, min(self.lo, other.lo), max(self.hi, other.hi))


@dataclass(frozen=True)
class Window:
    """The rows of `tensor` one instance keeps: `rows` rows starting at
    clamp(i·step + lo, 0, height − rows)."""

    tensor: str
    step: int
    lo: int
    rows: int
    height: int

    def to_json(self) -> dict[str, Any]:
        return {"tensor": self.tensor, "step": self.step, "lo": self.lo, "rows": self.rows}


@dataclass(frozen=True)
class ConvRows:
    """How a convolution's output rows read its input rows."""

    kernel: int
    stride: int
    dilation: int
    pad: int

    def needs(self, out: Rows) -> Rows:
        return Rows(out.step * self.stride, out.lo * self.stride - self.pad,
                    (out.hi - 1) * self.stride - self.pad + (self.kernel - 1) * self.dilation + 1)


def conv_rows(graph: Graph, op: Op) -> ConvRows:
    """The row geometry of a 2-D Conv (its attributes, ONNX's defaults)."""
    x, w, y = (graph.tensors[t].shape for t in (op.inputs[0], op.inputs[1], op.outputs[0]))
    kernel = w[2]
    stride = (op.attrs.get("strides") or [1, 1])[0]
    dilation = (op.attrs.get("dilations") or [1, 1])[0]
    auto_pad = op.attrs.get("auto_pad", "NOTSET")
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        total = max(0, (y[2] - 1) * stride + (kernel - 1) * dilation + 1 - x[2])
        pad = total // 2 if auto_pad == "SAME_UPPER" else total - total // 2
    elif auto_pad == "VALID":
        pad = 0
    else:
        pad = (op.attrs.get("pads") or [0, 0, 0, 0])[0]
    return ConvRows(kernel, stride, dilation, pad)


def is_row_conv(graph: Graph, op: Op) -> bool:
    """A 2-D float convolution over NCHW tensors (its output rows read a band of input rows)."""
    if op.op_type != "Conv" or len(graph.tensors[op.outputs[0]].shape) != 4:
        return False
    return graph.tensors[op.inputs[0]].dtype == "float32" and graph.is_constant(op.inputs[1])


def is_row_elementwise(graph: Graph, op: Op, batch: int) -> bool:
    """A One-to-One op on NCHW tensors whose activation inputs have the output's shape or
    broadcast along the rows only from constants."""
    out = graph.tensors[op.outputs[0]]
    if op.mapping != MappingType.ONE_TO_ONE or len(out.shape) != 4 or out.shape[0] != batch:
        return False
    if len(op.outputs) != 1 or out.dtype != "float32":
        return False
    for t in op.present_inputs():
        tensor = graph.tensors[t]
        if tensor.shape != out.shape and not tensor.is_constant:
            return False
    return True


def row_windows(graph: Graph, op_ids: Sequence[str], outputs: Sequence[str], parts: int
                ) -> dict[str, Window] | None:
    """The window of every tensor a stage keeps when it runs as `parts` row instances per
    image, or None when the stage cannot run that way (an op that does not carry rows, rows
    not divisible into `parts`, windows that do not line up)."""
    ops = [graph.op_by_id[i] for i in op_ids]
    members = set(op_ids)
    batch = graph.tensors[ops[-1].outputs[0]].shape[0]
    if not all(is_row_conv(graph, op) or is_row_elementwise(graph, op, batch) for op in ops):
        return None
    need: dict[str, Rows] = {}
    for t in outputs:
        shape = graph.tensors[t].shape
        if len(shape) != 4 or shape[ROW_DIM] % parts or shape[0] != batch:
            return None
        step = shape[ROW_DIM] // parts
        need[t] = Rows(step, 0, step)
    for op in reversed(ops):
        out = need.get(op.outputs[0])
        if out is None:
            continue
        reads = [op.inputs[0]] if is_row_conv(graph, op) else list(graph.activation_inputs(op))
        wanted = conv_rows(graph, op).needs(out) if is_row_conv(graph, op) else out
        for t in reads:
            producer = graph.producer(t)
            if producer is None or producer.id not in members:
                continue
            merged = need[t].union(wanted) if t in need else wanted
            if merged is None:
                return None
            need[t] = merged
    windows = {}
    for t, rows in need.items():
        height = graph.tensors[t].shape[ROW_DIM]
        windows[t] = Window(t, rows.step, rows.lo, min(height, rows.hi - rows.lo), height)
    return windows


def kept_tensors(graph: Graph, op_ids: Sequence[str], outputs: Sequence[str]) -> list[str]:
    """The tensors a row-tiled stage keeps in window buffers, in op order: every convolution's
    result the stage reads again and every input a convolution reads from inside the stage, and outputs the stage also
    reads itself. The other tensors of the stage are computed inside expressions (registers)."""
    members = set(op_ids)
    kept: set[str] = set()
    for op in (graph.op_by_id[i] for i in op_ids):
        if is_row_conv(graph, op):
            if any(c.id in members for c in graph.consumers(op.outputs[0])):
                kept.add(op.outputs[0])
            producer = graph.producer(op.inputs[0])
            if producer is not None and producer.id in members:
                kept.add(op.inputs[0])
    kept |= {t for t in outputs if any(c.id in members for c in graph.consumers(t))}
    return [t for i in op_ids for t in graph.op_by_id[i].outputs if t in kept]


def kept_liveness(graph: Graph, op_ids: Sequence[str], kept: Sequence[str]
                  ) -> dict[str, tuple[int, int]]:
    """(first, last) positions in the stage's op order of each kept tensor: written by its
    producer, read until the last kept tensor or output computed from it (through the ops
    evaluated inside expressions) is written."""
    position = {op_id: i for i, op_id in enumerate(op_ids)}
    kept_set = set(kept)

    def last_use(t: str) -> int:
        last = position[graph.producer(t).id]
        for c in graph.consumers(t):
            if c.id not in position:
                continue
            out = c.outputs[0]
            last = max(last, position[c.id] if out in kept_set or is_row_conv(graph, c)
                       else last_use(out))
        return last

    return {t: (position[graph.producer(t).id], last_use(t)) for t in kept}


# --- §4.3: allocation with reuse, longest-liveness spilling ----------------------------------

@dataclass(frozen=True)
class Placed:
    """A buffer of one instance: its scope, its offset in that scope, and when it lives (the
    positions of the computations in the instance that write and last read it)."""

    tensor: str
    nbytes: int
    first: int
    last: int
    scope: str
    offset: int

    def to_json(self) -> dict[str, Any]:
        return {"tensor": self.tensor, "bytes": self.nbytes, "scope": self.scope,
                "offset": self.offset, "live": [self.first, self.last]}


def allocate(buffers: Sequence[tuple[str, int, int, int]], capacities: Sequence[tuple[str, int]]
             ) -> list[Placed]:
    """Places (tensor, nbytes, first, last) buffers in scopes of the given capacities (fastest
    first; the last one is unbounded). A buffer released after its last read leaves its bytes
    to later buffers. When a buffer does not fit among the live ones of a scope, the live buffer
    with the longest liveness (the new one included) moves to the next scope — GraphTurbo's
    choice, which tends to spill a buffer that is small, rather than the largest one."""
    pending = sorted(buffers, key=lambda b: (b[2], b[3], b[0]))
    level_of = {b[0]: 0 for b in pending}
    while True:
        placed = _place_levels(pending, level_of, capacities)
        if isinstance(placed, list):
            return placed
        level_of[placed] += 1  # the buffer chosen to spill one level down


def _place_levels(pending, level_of, capacities) -> list[Placed] | str:
    """Offsets per scope by first fit among live buffers, or the tensor to spill."""
    placed: list[Placed] = []
    for tensor, nbytes, first, last in pending:
        level = level_of[tensor]
        scope, capacity = capacities[level]
        live = sorted((p for p in placed if p.scope == scope and p.last >= first),
                      key=lambda p: p.offset)
        offset = _first_fit(live, nbytes)
        bounded = level < len(capacities) - 1
        if bounded and offset + nbytes > capacity:
            candidates = [p for p in live] + [Placed(tensor, nbytes, first, last, scope, 0)]
            return max(candidates, key=lambda p: (p.last - p.first, p.nbytes, p.tensor)).tensor
        placed.append(Placed(tensor, nbytes, first, last, scope, offset))
    return placed


def _first_fit(live: list[Placed], nbytes: int) -> int:
    cursor = 0
    for p in live:
        if p.offset - cursor >= nbytes:
            return cursor
        cursor = max(cursor, -(-(p.offset + p.nbytes) // ALIGN) * ALIGN)
    return cursor


def scope_of_bytes(nbytes: int, capacities: Sequence[tuple[str, int]]) -> str:
    """The fastest scope a buffer fits alone."""
    return next((scope for scope, capacity in capacities if nbytes <= capacity),
                capacities[-1][0])
