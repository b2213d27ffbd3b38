"""Which fused epilogues of a product a micro-kernel can apply to its accumulators in registers:
call-free math over the sum and values constant along one axis of the tile (a bias per output
channel or per column, a scalar), into one output; as a `TileEpilogue` and the operands' offsets."""
from __future__ import annotations

from dataclasses import dataclass

from kiln.codegen import ir
from kiln.codegen.expr import Expr, substitute, walk
from kiln.codegen.gemm.spec import stride_of
from kiln.codegen.microkernel import (
    TILE_EPILOGUE_OPS,
    EpilogueNode,
    TileEpilogue,
    epilogue_constant,
)


@dataclass(frozen=True)
class RegisterEpilogue:
    """The results' one store (its offset over the product's `i`, `j` and batch) and the math
    before it: `epilogue` None when the store takes the sum unchanged; `operands`, the offset of
    each operand's element at (i, j) (read at the tile's first element)."""

    store: ir.Store
    epilogue: TileEpilogue | None
    operands: tuple[tuple[str, Expr], ...]

    def operands_at(self, mapping: dict[Expr, Expr]) -> tuple[tuple[str, Expr], ...]:
        return tuple((name, substitute(offset, mapping)) for name, offset in self.operands)


def register_epilogue(stmts: list[ir.Stmt], total: Expr, axes: tuple[Expr, Expr, Expr],
                      rows_cross_batches: bool,
                      tile_operands: bool = False) -> RegisterEpilogue | None:
    """`stmts` (the results of `total` at (i, j) of batch `b`, `axes` = (i, j, b)) as one store
    of call-free math, or None. Rows that cross batches (a folded product) admit no operand that
    moves with the row or the batch; `tile_operands` admits one that moves with both (a residual
    read tile by tile, contiguous along the columns)."""
    *lets, store = stmts if stmts else [None]
    if not isinstance(store, ir.Store) or not all(isinstance(s, ir.Let) for s in lets):
        return None
    if store.value.dtype != total.dtype:
        return None
    values = _inlined({s.local: s.value for s in lets})
    builder = _Builder(total, axes, rows_cross_batches, tile_operands)
    try:
        node = builder.node(substitute(store.value, values) if values else store.value)
    except _NotInRegisters:
        return None
    if node == ("total",):
        return RegisterEpilogue(store, None, ())
    epilogue = TileEpilogue(node, tuple(strides for _, _, strides in builder.operands))
    return RegisterEpilogue(store, epilogue,
                            tuple((name, offset) for name, offset, _ in builder.operands))


class _NotInRegisters(Exception):
    pass


def _inlined(values: dict[Expr, Expr]) -> dict[Expr, Expr]:
    """Each Let's value with the earlier Lets it reads substituted in (they come in order)."""
    done: dict[Expr, Expr] = {}
    for local, value in values.items():
        done[local] = substitute(value, done) if done else value
    return done


class _Builder:
    def __init__(self, total: Expr, axes: tuple[Expr, Expr, Expr], rows_cross_batches: bool,
                 tile_operands: bool):
        self.total, self.axes, self.rows_cross_batches = total, axes, rows_cross_batches
        self.tile_operands = tile_operands
        self.operands: list[tuple[str, Expr, tuple[int, int]]] = []
        self.memo: dict[Expr, EpilogueNode] = {}

    def node(self, e: Expr) -> EpilogueNode:
        if e not in self.memo:
            self.memo[e] = self._node(e)
        return self.memo[e]

    def _node(self, e: Expr) -> EpilogueNode:
        if e is self.total:
            return ("total",)
        if e.op == "const" and e.dtype == self.total.dtype and epilogue_constant(e.value):
            return ("const", float(e.value))
        if e.op == "load" and e.dtype == self.total.dtype:
            return ("operand", self._operand(e))
        if e.op in TILE_EPILOGUE_OPS and [a.dtype for a in e.args] == self._operand_types(e):
            return (e.op, *(self.node(a) for a in e.args))
        raise _NotInRegisters

    def _operand_types(self, e: Expr) -> list[str]:
        """The argument types a vector form of `e` takes: lane masks for the logic, values for
        the arithmetic and comparisons, a mask and two values for a select."""
        value = self.total.dtype
        if e.op in ("and", "or", "not"):
            return ["bool"] * TILE_EPILOGUE_OPS[e.op] if e.dtype == "bool" else []
        if e.op == "select":
            return ["bool", value, value] if e.dtype == value else []
        if e.dtype not in (value, "bool"):
            return []
        return [value] * TILE_EPILOGUE_OPS[e.op]

    def _operand(self, e: Expr) -> int:
        """Operand `e`'s number, if it is constant along the tile's rows or its columns, or (with
        `tile_operands`) contiguous along its columns."""
        offset = e.args[0]
        i, j, b = self.axes
        if not {v for v in walk([offset]) if v.op == "var"} <= {i, j, b}:
            raise _NotInRegisters
        row, col = stride_of(e, i), stride_of(e, j)
        batch = stride_of(e, b)
        if row is None or col is None or batch is None or col not in (0, 1):
            raise _NotInRegisters
        if row and col and not (self.tile_operands and row > 0):
            raise _NotInRegisters
        if self.rows_cross_batches and (row or batch):
            raise _NotInRegisters
        for n, (name, seen, _) in enumerate(self.operands):
            if name == e.name and seen is offset:
                return n
        self.operands.append((e.name, offset, (row, col)))
        return len(self.operands) - 1
