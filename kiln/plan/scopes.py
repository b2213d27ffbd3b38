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
    if any(graph.tensors[t].numel == 0 for op in ops for t in op.outputs):
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


def epilogue_target(graph: Graph, op_ids: Sequence[str], outputs: Sequence[str], tensor: str
                    ) -> str | None:
    """The tensor a convolution's result flows into through a chain of elementwise ops, each
    the only reader of the one before, when the chain ends at a tensor the stage keeps or
    stores: the convolution then stores that tensor, the chain evaluated in registers on each
    result (loop fusion within a layer, §4.1). None when the result is read otherwise."""
    members = set(op_ids)
    batch = graph.tensors[tensor].shape[0]
    current = tensor
    while current not in outputs:
        readers = [c for c in graph.consumers(current) if c.id in members]
        if len(readers) != 1 or not is_row_elementwise(graph, readers[0], batch):
            return None
        if any(is_row_conv(graph, c) for c in graph.consumers(current)):
            return None
        nxt = readers[0].outputs[0]
        if graph.tensors[nxt].shape != graph.tensors[tensor].shape:
            return None
        if not all(_ready_before(graph, members, v, tensor)
                   for v in graph.activation_inputs(readers[0]) if v != current):
            return None
        current = nxt
        if _read_by_conv(graph, members, current):
            return current
    return current if current != tensor else None


def _ready_before(graph: Graph, members: set[str], tensor: str, result: str) -> bool:
    """Is `tensor` in a buffer when the convolution computing `result` runs: an input of the
    stage, or a kept tensor (one a convolution reads) computed before that convolution?"""
    producer = graph.producer(tensor)
    if producer is None or producer.id not in members:
        return True
    return (_read_by_conv(graph, members, tensor)
            and graph.order[producer.id] < graph.order[graph.producer(result).id])


def _read_by_conv(graph: Graph, members: set[str], tensor: str) -> bool:
    return any(c.id in members and is_row_conv(graph, c) for c in graph.consumers(tensor))


def kept_tensors(graph: Graph, op_ids: Sequence[str], outputs: Sequence[str]) -> list[str]:
    """The tensors a row-tiled stage keeps in window buffers, in op order: every input a
    convolution reads from inside the stage, outputs the stage also reads itself, and
    convolution results read again other than through an elementwise chain into one of
    those (`epilogue_target`). The other tensors of the stage are computed inside expressions
    (registers)."""
    members = set(op_ids)
    kept = {t for t in graph.tensors if _read_by_conv(graph, members, t)
            and (p := graph.producer(t)) is not None and p.id in members}
    kept |= {t for t in outputs if any(c.id in members for c in graph.consumers(t))}
    for op in (graph.op_by_id[i] for i in op_ids):
        t = op.outputs[0]
        if (is_row_conv(graph, op) and t not in kept
                and any(c.id in members for c in graph.consumers(t))
                and epilogue_target(graph, op_ids, outputs, t) is None):
            kept.add(t)
    return [t for i in op_ids for t in graph.op_by_id[i].outputs if t in kept]


def kept_liveness(graph: Graph, op_ids: Sequence[str], outputs: Sequence[str],
                  kept: Sequence[str]) -> dict[str, tuple[int, int]]:
    """(first, last) positions in the stage's op order of each kept tensor: from the op that
    computes it (the convolution, for the target of its epilogue) until the last kept tensor or
    output computed from it (through ops evaluated inside expressions) is written."""
    position = {op_id: i for i, op_id in enumerate(op_ids)}
    kept_set = set(kept)
    written = {t: position[graph.producer(t).id] for t in kept}
    for op_id in op_ids:
        op = graph.op_by_id[op_id]
        if is_row_conv(graph, op):
            target = epilogue_target(graph, op_ids, outputs, op.outputs[0])
            if target in written:
                written[target] = position[op_id]

    def last_use(t: str) -> int:
        last = position[graph.producer(t).id]
        for c in graph.consumers(t):
            if c.id not in position:
                continue
            out = c.outputs[0]
            last = max(last, position[c.id] if out in kept_set or is_row_conv(graph, c)
                       else last_use(out))
        return last

    return {t: (written[t], last_use(t)) for t in kept}


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
