"""FusionStitching's schedule space and its propagation through a fusion (§4.1–4.2, Table 1).

A schedule of an op is a triple on its output shape (the work space): `split_dim`, the dimension
where the work is split; `sword`, into how many parts that dimension is split (a divisor of its
extent); `sched_type`, Row or Column (Fig. 5). A Row schedule makes the dims left of `split_dim`
and the `sword` parts of it the blocks: each block is one contiguous chunk of the row-major
output, `blocks = ∏ shape[:split_dim] · sword`. A Column schedule makes the dims right of it and
the parts the blocks: `blocks = sword · ∏ shape[split_dim+1:]`, each block a strided set of
columns. On a GPU a block is a thread block (CTA); on a CPU it is one chunk of a stage's parallel
loop, and code generation (`Schedule.stitch_blocks`) deals chunk k of every stage of a stitched
kernel to the same thread. A Row chunk is a range of rows; a Column one (`Schedule.stitch_columns`
= `column_extent`, the elements from split_dim on) a contiguous range of those columns, with the
rows looped inside it (`kiln.codegen.columns`): the CPU's blocks group adjacent columns where the
GPU's stride, so that a thread's inner loop reads contiguous, vectorisable memory.

Two schedules of one tensor agree when they cut it into the same blocks: for a Row schedule that
is the number of blocks alone (equal contiguous chunks), for a Column schedule too (the block
structure is fixed by its suffix); `partition` is that canonical key, and one block is one block
whichever the type.

Propagation (`propagate`) starts from the schedule of every root (an op whose output leaves the
fusion) and walks the fusion backwards, turning each op's output schedule into the schedule each
input produced inside the fusion must have, by the op's record:

* elementwise (One-to-One): passed as it is, Row or Column;
* broadcast (an input of lower rank or with extent-1 dims, and One-to-Many ops such as Expand
  whose input broadcasts to the output the numpy way): `split_dim` moves
  with the right-aligned dims and `sword` becomes 1 on a broadcast dim; a split on dims the input
  lacks leaves it whole in every block (Row) or element by element (Column);
* reshape (Reorganize ops, which keep the row-major order): a Row schedule becomes the Row
  schedule with the same blocks on the input shape, a Column schedule the one with the same
  column suffix; unsatisfiable if there is none;
* transpose (Shuffle ops, permutation from `perm`): Row passes when `split_dim` is left of every
  moved dim (or on the first one with sword 1), Column when right of every moved dim;
* reduce (row-local reductions and normalisations: every reduced dim in one block): Row passes
  when `split_dim` is left of the reduced dims, Column when it is right of them, with dims
  renumbered when the reduction drops them;
* anything else (slices, concatenations, gathers, tiles read unaligned data; library calls are
  never inside a fusion): only the one-block schedule passes.

A reduction reading a tensor from outside the fusion constrains its own schedule all the same
(§4.2: all reduced dims in one block), so a Row split of a column reduction does not pass.

A tensor read by several ops of the fusion must be asked for one partition by all of them; a
conflict makes the root schedule unsatisfiable. `satisfiable` runs the paper's two-stage search
for several roots: the blocks every root can have are intersected, then each is propagated.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Iterable, Sequence

from kiln.ecg import Graph, Op
from kiln.mapping import MappingType
from kiln.ops import RowLocality, op_info

Shape = tuple[int, ...]


class SchedType(Enum):
    ROW = "row"
    COLUMN = "column"


ROW, COLUMN = SchedType.ROW, SchedType.COLUMN


@dataclass(frozen=True)
class StitchSchedule:
    split_dim: int
    sword: int
    sched_type: SchedType

    def blocks(self, shape: Shape) -> int:
        dims = _dims(shape)
        if self.sched_type is ROW:
            return math.prod(dims[:self.split_dim]) * self.sword
        return self.sword * math.prod(dims[self.split_dim + 1:])

    def partition(self, shape: Shape) -> tuple[SchedType, int]:
        """The canonical key of the blocks this schedule cuts `shape` into."""
        blocks = self.blocks(shape)
        return (ROW if blocks == 1 else self.sched_type, blocks)

    def legal(self, shape: Shape) -> bool:
        dims = _dims(shape)
        return (0 <= self.split_dim < len(dims) and self.sword >= 1
                and dims[self.split_dim] % self.sword == 0)


ONE_BLOCK = StitchSchedule(0, 1, ROW)


def _dims(shape: Shape) -> Shape:
    return tuple(shape) if len(shape) else (1,)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0] if n > 0 else [1]


def schedule_space(shape: Shape, max_blocks: int) -> list[StitchSchedule]:
    """Every legal (split_dim, sword, sched_type) on `shape` with at most `max_blocks` blocks."""
    dims = _dims(shape)
    space = []
    for split_dim, extent in enumerate(dims):
        for sword in divisors(extent):
            for kind in SchedType:
                schedule = StitchSchedule(split_dim, sword, kind)
                if 1 <= schedule.blocks(dims) <= max_blocks:  # an empty tensor: nothing to split
                    space.append(schedule)
    return space


def with_partition(shape: Shape, key: tuple[SchedType, int]) -> StitchSchedule | None:
    """A schedule of `shape` whose blocks are `key`, or None (the smallest split_dim)."""
    kind, blocks = key
    dims = _dims(shape)
    if blocks == 1:
        return ONE_BLOCK
    if blocks < 1:
        return None
    order = range(len(dims)) if kind is ROW else range(len(dims) - 1, -1, -1)
    for split_dim in order:
        outside = (math.prod(dims[:split_dim]) if kind is ROW
                   else math.prod(dims[split_dim + 1:]))
        if outside and blocks % outside == 0:
            sword = blocks // outside
            if dims[split_dim] % sword == 0:
                return StitchSchedule(split_dim, sword, kind)
    return None


def column_extent(shape: Shape, key: tuple[SchedType, int]) -> int:
    """The columns a Column partition of `shape` splits (the elements from its split_dim on), or
    0 for a Row partition."""
    schedule = with_partition(shape, key)
    if key[0] is not COLUMN or schedule is None or schedule.sched_type is not COLUMN:
        return 0
    return math.prod(_dims(shape)[schedule.split_dim:])


# --- Table 1: one op's output schedule -> its input's ------------------------------------------

def input_schedule(graph: Graph, op: Op, position: int,
                   out: StitchSchedule) -> StitchSchedule | None:
    """The schedule input `position` of `op` must have so that `op` runs with `out` on its first
    output, or None when Table 1 does not pass `out` through `op`."""
    if out.blocks(graph.tensors[op.outputs[0]].shape) == 1:
        return ONE_BLOCK
    out_shape = _dims(graph.tensors[op.outputs[0]].shape)
    in_shape = _dims(graph.tensors[op.inputs[position]].shape)
    info = op_info(op.op_type)
    if info.compute_intensive or info.opaque or info.recurrent or len(op.outputs) != 1:
        return None
    if op.mapping in (MappingType.ONE_TO_ONE, MappingType.ONE_TO_MANY):
        if not broadcasts_to(in_shape, out_shape):
            return None  # a slice, concatenation, gather or tile: blocks read unaligned data
        return broadcast_rule(out_shape, in_shape, out)
    if op.mapping == MappingType.REORGANIZE:
        return reshape_rule(out_shape, in_shape, out) if position == 0 else None
    if op.mapping == MappingType.SHUFFLE:
        return transpose_rule(_perm(op, len(in_shape)), out) if position == 0 else None
    if reduces(op):
        reduced = reduced_dims(graph, op)
        if position != 0 or reduced is None:
            return None
        return reduce_rule(in_shape, out_shape, reduced, out)
    return None


def reduces(op: Op) -> bool:
    """A row-local reduction or normalisation: every block must hold all its reduced dims."""
    return op.mapping == MappingType.MANY_TO_MANY and op_info(op.op_type).row_locality not in (
        RowLocality.NONE, RowLocality.MATRIX_ROWS)


def broadcasts_to(in_shape: Shape, out_shape: Shape) -> bool:
    """Numpy broadcasting: right-aligned, every input dim equal to the output's or 1."""
    return len(in_shape) <= len(out_shape) and all(
        i in (1, o) for i, o in zip(reversed(in_shape), reversed(out_shape)))


def broadcast_rule(out_shape: Shape, in_shape: Shape, out: StitchSchedule) -> StitchSchedule:
    offset = len(out_shape) - len(in_shape)
    dim = out.split_dim - offset
    if dim < 0:  # split on dims the input lacks
        return ONE_BLOCK if out.sched_type is ROW else StitchSchedule(0, in_shape[0], COLUMN)
    sword = out.sword if in_shape[dim] == out_shape[out.split_dim] else 1
    return StitchSchedule(dim, sword, out.sched_type)


def reshape_rule(out_shape: Shape, in_shape: Shape, out: StitchSchedule) -> StitchSchedule | None:
    if math.prod(out_shape) != math.prod(in_shape):
        return None
    if out.sched_type is ROW:
        return with_partition(in_shape, out.partition(out_shape))
    suffix = math.prod(out_shape[out.split_dim + 1:])
    for dim in range(len(in_shape)):
        if (math.prod(in_shape[dim + 1:]) == suffix
                and (out.sword == 1 or in_shape[dim] == out_shape[out.split_dim])):
            return StitchSchedule(dim, out.sword, COLUMN)
    return None


def transpose_rule(perm: Sequence[int] | None, out: StitchSchedule) -> StitchSchedule | None:
    if perm is None:
        return None  # the one-block schedule was passed already
    moved = [i for i, p in enumerate(perm) if p != i]
    if not moved:
        return out
    first, last = min(moved), max(moved)
    if out.sched_type is ROW and (out.split_dim < first or (out.split_dim == first and out.sword == 1)):
        return out
    if out.sched_type is COLUMN and (out.split_dim > last or (out.split_dim == last and out.sword == 1)):
        return out
    return None


def reduce_rule(in_shape: Shape, out_shape: Shape, reduced: frozenset[int],
                out: StitchSchedule) -> StitchSchedule | None:
    """Every reduced dim stays inside one block: Row left of them, Column right of them."""
    kept = [d for d in range(len(in_shape)) if d not in reduced]
    if len(out_shape) == len(in_shape):
        dim = out.split_dim
    elif out.split_dim < len(kept):
        dim = kept[out.split_dim]
    else:
        return None
    if out.sched_type is ROW and dim <= min(reduced) and (dim < min(reduced) or out.sword == 1):
        return StitchSchedule(dim, out.sword, ROW)
    if out.sched_type is COLUMN and dim >= max(reduced) and (dim > max(reduced) or out.sword == 1):
        return StitchSchedule(dim, out.sword, COLUMN)
    return None


def reduced_dims(graph: Graph, op: Op) -> frozenset[int] | None:
    """The input dims a row-local op reduces over (its record says where they are given)."""
    rank = len(graph.tensors[op.inputs[0]].shape)
    if rank == 0:
        return None
    locality = op_info(op.op_type).row_locality
    if locality is RowLocality.REDUCED_AXES:
        axes_input = op.inputs[1] if len(op.inputs) > 1 and op.inputs[1] else None
        if axes_input is None:
            axes = op.attrs.get("axes")
            return frozenset(int(a) % rank for a in axes) if axes else frozenset(range(rank))
        if not graph.is_constant(axes_input):
            return None
        axes = graph.tensors[axes_input].data.reshape(-1)
        return frozenset(int(a) % rank for a in axes) if axes.size else frozenset(range(rank))
    axis = int(op.attrs.get("axis", -1)) % rank
    if locality is RowLocality.LAST_AXIS:
        return frozenset({axis})
    return frozenset(range(axis, rank))


def _perm(op: Op, rank: int) -> tuple[int, ...] | None:
    """The permutation of a Shuffle op, or None when it has none to read (every dim may move)."""
    perm = op.attrs.get("perm")
    if perm is None or len(perm) != rank:
        return None
    return tuple(int(p) for p in perm)


# --- a fusion -----------------------------------------------------------------------------

def fusion_outputs(graph: Graph, members: set[str]) -> list[str]:
    """Tensors of the fusion read after it or returned by the model (its roots' outputs)."""
    outs = set(graph.outputs)
    return [t for op_id in sorted(members, key=graph.order.__getitem__)
            for t in graph.op_by_id[op_id].outputs
            if t in outs or any(c.id not in members for c in graph.consumers(t))]


def propagate(graph: Graph, members: set[str], roots: dict[str, StitchSchedule],
              bypass: Callable[[Op], bool] | None = None) -> dict[str, StitchSchedule] | None:
    """The schedule of every tensor the fusion produces, from its roots' (tensor -> schedule),
    or None when some op cannot run with what its consumers ask of it. An op `bypass` accepts
    whose rule fails constrains nothing above it (§4.3: trivial reshapes and small transposes
    are composed into their consumers' threads instead)."""
    wanted: dict[str, StitchSchedule] = dict(roots)
    for op_id in sorted(members, key=graph.order.__getitem__, reverse=True):
        op = graph.op_by_id[op_id]
        out = wanted.get(op.outputs[0])
        if out is None:
            continue  # computed only for another output of a multi-output op
        if not _outputs_agree(graph, op, out, wanted):
            return None
        for position, tensor in enumerate(op.inputs):
            producer = graph.producer(tensor) if tensor else None
            if producer is None or producer.id not in members:
                if position == 0 and reduces(op) and input_schedule(graph, op, 0, out) is None:
                    return None  # its own reduced dims would be split, whoever produced them
                continue
            asked = input_schedule(graph, op, position, out)
            if asked is None and bypass is not None and bypass(op):
                continue
            if asked is None:
                return None
            shape = graph.tensors[tensor].shape
            if not asked.legal(shape):
                return None
            held = wanted.get(tensor)
            if held is not None and held.partition(shape) != asked.partition(shape):
                return None
            wanted[tensor] = asked
    return wanted


def _outputs_agree(graph: Graph, op: Op, out: StitchSchedule,
                   wanted: dict[str, StitchSchedule]) -> bool:
    """A multi-output op runs with one schedule: the others must be asked for nothing else."""
    first = graph.tensors[op.outputs[0]].shape
    for tensor in op.outputs[1:]:
        held = wanted.get(tensor)
        shape = graph.tensors[tensor].shape
        if held is not None and (shape != first or held.partition(shape) != out.partition(first)):
            return False
    return True


@dataclass(frozen=True)
class Resolved:
    """A satisfiable schedule of a whole fusion: its blocks and every produced tensor's triple."""

    key: tuple[SchedType, int]
    schedules: dict[str, StitchSchedule]

    @property
    def blocks(self) -> int:
        return self.key[1]


def root_keys(graph: Graph, members: set[str], max_blocks: int,
              kinds: Iterable[SchedType] = (ROW, COLUMN)) -> set[tuple[SchedType, int]]:
    """Stage one for several roots: the partitions (of at most `max_blocks` blocks) that every
    output of the fusion can have; one block always."""
    kinds = tuple(kinds)
    keys: set[tuple[SchedType, int]] | None = None
    for tensor in fusion_outputs(graph, members):
        shape = graph.tensors[tensor].shape
        own = {s.partition(shape) for s in schedule_space(shape, max_blocks) if s.sched_type in kinds}
        own.add((ROW, 1))
        keys = own if keys is None else keys & own
    return keys if keys is not None else {(ROW, 1)}


def resolve(graph: Graph, members: set[str], key: tuple[SchedType, int],
            bypass: Callable[[Op], bool] | None = None) -> Resolved | None:
    """Stage two for one partition: the roots' schedules with those blocks, propagated."""
    roots = {t: with_partition(graph.tensors[t].shape, key) for t in fusion_outputs(graph, members)}
    if any(s is None for s in roots.values()):
        return None
    schedules = propagate(graph, members, roots, bypass)  # type: ignore[arg-type]
    return None if schedules is None else Resolved(key, schedules)


def satisfiable(graph: Graph, members: set[str], max_blocks: int,
                kinds: Iterable[SchedType] = (ROW, COLUMN),
                bypass: Callable[[Op], bool] | None = None) -> list[Resolved]:
    """Every partition the fusion's roots can all have that propagates through the fusion (the
    paper's two stages), fewest blocks first."""
    keys = sorted(root_keys(graph, members, max_blocks, kinds), key=lambda k: (k[1], k[0].value))
    return [r for r in (resolve(graph, members, k, bypass) for k in keys) if r is not None]
