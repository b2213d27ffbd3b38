"""FusionStitching's Column schedules (§4.1, Fig. 5 right) realised on a CPU.

A Column schedule (split_dim, sword, Column) makes the dims from `split_dim` on the blocks'
dimension: every block holds whole columns, each with all of its rows, so a reduction over the
outer dims (ReduceSum/ReduceMean over axis 0, BatchNorm statistics over N·H·W of an NHWC tensor,
a Softmax over axis 0) finishes inside one block, and so does every later stage that reads it.
On a GPU a block is a thread block striding over its columns. On a CPU the columns are the
contiguous, row-major inner dims, so a thread's share is a contiguous range of columns and its
inner loop runs along that range with vector loads and stores; the rows are the loops outside.

`Schedule.stitch_columns` = C (the product of the dims from split_dim on: the columns) with
`Schedule.stitch_blocks` = B cuts the columns into B chunks of ceil(C/B), and every stage of the
kernel that can run by columns runs as

    parallel for k in [0, B)            static: chunk k goes to thread k mod T, in every stage
      for j in tiles of chunk k         at most COLUMN_TILE columns: accumulators stay in L1
        for rows ...                    the reduced or elementwise rows (and a batch outside)
          simd for c in [lo, hi)        contiguous columns: vector loads, no stride

so the columns a thread wrote to the kernel's scratch in one stage are the ones it reads back in
the next, from its own L1/L2 (FusionStitching's shared memory). Two stage forms are rewritten:

* an elementwise stage over R·C elements: element r·C + c;
* a row stage whose view reduces dims that lie left of its C kept columns (`column_view`): the
  body the row lowering built for one column `o` (per phase an accumulator, a loop over the
  reduced extent, a finished value; stores per column and per element) is distributed over its
  statements with the column loop moved inside each (loop interchange): accumulators and
  finished values become arrays over the tile (scalar expansion), and a phase's kept row values
  an array of rows × tile, so the tile shrinks to keep that within `KEPT_ELEMENTS`.

Any other stage (an anchor, a row stage over the last axis) keeps its own loop, split into the B
static blocks; stages are separated by barriers, so a schedule changes where each thread's data
is, never the result.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from kiln.codegen import ir
from kiln.codegen.contexts import RowView
from kiln.codegen.expr import (
    Expr,
    add,
    array_load,
    iconst,
    imin,
    mul,
    replace_nodes,
    sub,
    substitute,
    var,
    walk,
)
from kiln.codegen.schedule import Schedule

COLUMN_TILE = 256  # columns per tile: a float32 accumulator array of 1 KiB
KEPT_ELEMENTS = 1 << 14  # a tile's kept row values: at most 64 KiB of float32 on the stack


@dataclass(frozen=True)
class ColumnChunks:
    """C columns cut into B contiguous chunks of ceil(C/B)."""

    columns: int
    blocks: int

    @property
    def width(self) -> int:
        return -(-self.columns // self.blocks)


def column_chunks(schedule: Schedule) -> ColumnChunks | None:
    """The schedule's column chunks, or None for a Row (or unstitched) schedule."""
    if schedule.stitch_blocks <= 0 or schedule.stitch_columns <= 0:
        return None
    columns = schedule.stitch_columns
    return ColumnChunks(columns, min(schedule.stitch_blocks, columns))


@dataclass(frozen=True)
class Tile:
    """One tile of a chunk: chunk k, tile j of it (of at most `width` columns), its columns
    [lo, hi) and their variable c (declared over all C columns)."""

    k: Expr
    j: Expr
    tiles: int
    width: int
    c: Expr
    lo: Expr
    hi: Expr


def tile_of(names: Callable[[str], str], chunks: ColumnChunks, width: int) -> Tile:
    """The tiles of at most `width` columns of every chunk."""
    width = max(1, min(width, chunks.width))
    tiles = -(-chunks.width // width)
    k, j = var(names("k"), chunks.blocks), var(names("j"), tiles)
    start = mul(k, chunks.width)
    lo = add(start, mul(j, width))
    hi = imin(add(lo, width), imin(add(start, chunks.width), iconst(chunks.columns)))
    return Tile(k, j, tiles, width, var(names("c"), chunks.columns), lo, hi)


def chunk_nest(chunks: ColumnChunks, tile: Tile, body: list[ir.Stmt]) -> ir.Loop:
    """The parallel loop over the chunks (static: chunk k to thread k mod T) and the loop over
    each one's tiles around `body`, one tile's work."""
    tile_loop = ir.Loop(tile.j, iconst(0), iconst(tile.tiles), body)
    return ir.Loop(tile.k, iconst(0), iconst(chunks.blocks), [tile_loop], parallel=1,
                   grain="blocks", blocks=chunks.blocks)


def columns_loop(c: Expr, lo: Expr, hi: Expr, body: list[ir.Stmt]) -> ir.Loop:
    return ir.Loop(c, lo, hi, body, simd=True)


# --- elementwise stages -------------------------------------------------------------------------

def column_elementwise(names: Callable[[str], str], chunks: ColumnChunks, numel: int,
                       stores_at: Callable[[Expr], list[ir.Stmt]]) -> ir.Loop | None:
    """An elementwise stage over `numel` elements (R rows of the C columns) by column chunks;
    `stores_at(i)` are its stores of flat element i. None when numel is not R·C."""
    if numel < chunks.columns or numel % chunks.columns:
        return None
    rows = numel // chunks.columns
    tile = tile_of(names, chunks, COLUMN_TILE)
    r = var(names("r"), rows)
    across = columns_loop(tile.c, tile.lo, tile.hi, stores_at(add(mul(r, chunks.columns), tile.c)))
    return chunk_nest(chunks, tile, [ir.Loop(r, iconst(0), iconst(rows), [across])])


# --- row stages that reduce over outer dims ------------------------------------------------------

def column_view(view: RowView, columns: int) -> int | None:
    """The batch P when `view` reduces a contiguous run of dims followed by dims of exactly
    `columns` elements (its rows o = p·C + c), else None (a row reduction: not by columns)."""
    axes = view.axes
    if not axes or list(axes) != list(range(axes[0], axes[-1] + 1)):
        return None
    if math.prod(view.shape[axes[-1] + 1:]) != columns:
        return None
    return math.prod(view.shape[:axes[0]])


def column_row_stage(names: Callable[[str], str], chunks: ColumnChunks, view: RowView, o: Expr,
                     body: list[ir.Stmt]) -> ir.Loop | None:
    """A row stage's loop over rows `o` (body: the statements of one row) rewritten by column
    chunks, or None when its view is not a column reduction of these columns or its body holds
    a statement the rewrite does not know."""
    batch = column_view(view, chunks.columns)
    if batch is None:
        return None
    kept = sum(stmt.size for stmt in body if isinstance(stmt, ir.DeclArray))
    width = COLUMN_TILE if not kept else max(1, min(COLUMN_TILE, KEPT_ELEMENTS // kept))
    tile = tile_of(names, chunks, width)
    p = var(names("p"), batch)
    expansion = _Expansion(names, tile, {o: add(mul(p, chunks.columns), tile.c)})
    stmts = expansion.statements(body)
    if stmts is None:
        return None
    return chunk_nest(chunks, tile, [ir.Loop(p, iconst(0), iconst(batch), stmts)])


# --- row stages whose rows lie side by side in memory -----------------------------------------

ROWS_TILE = 64  # rows of such a stage per tile at most: four AVX-512 vectors along the rows
ROWS_TILES = 4  # tiles at least while each keeps 16 rows (work for every thread of a few)


def rows_across_lanes(names: Callable[[str], str], rows: int, o: Expr,
                      body: list[ir.Stmt]) -> ir.Loop | None:
    """A row stage whose every load that moves with the row `o` steps by one element (the rows
    lie side by side, their elements a stride apart: a LayerNorm over the channels of an NCHW
    tensor read as NHWC through a Transpose) rewritten as a column reduction over its rows: tiles
    of up to `ROWS_TILE` rows (narrower, down to 16, for `ROWS_TILES` tiles: ConvNeXt-T's 7 × 7
    pixels in one tile ran 1.5× the time of the transpose and the row-by-row LayerNorm apart
    with 2 threads), each statement's loop running along the tile with vector loads (the
    interchange and scalar expansion above). Row by row, every phase would gather each row's
    elements one by one. None when a load moves otherwise, or the body holds a statement the
    rewrite does not know."""
    moving = [_stride(e, o) for e in walk(ir.all_exprs(body)) if e.op == "load"]
    moving = [m for m in moving if m != 0]
    if rows < 2 or not moving or any(m != 1 for m in moving):
        return None
    width = min(ROWS_TILE, -(-rows // (ROWS_TILES * 16)) * 16)  # whole vectors of 16
    tiles = -(-rows // width)
    k = var(names("k"), tiles)
    lo = mul(k, width)
    tile = Tile(k, k, 1, width, var(names("c"), rows), lo, imin(add(lo, width), iconst(rows)))
    stmts = _Expansion(names, tile, {o: tile.c}, hoist=True).statements(body)
    if stmts is None:
        return None
    return ir.Loop(k, iconst(0), iconst(tiles), stmts, parallel=1, grain="chunks")


def _stride(load: Expr, v: Expr) -> int | None:
    """How far a load's offset moves when `v` grows by one (None: not by a constant)."""
    offset = load.args[0]
    delta = sub(substitute(offset, {v: add(v, 1)}), offset)
    return delta.value if delta.is_const else None


class _Expansion:
    """Loop distribution of a row body over its statements, the column loop interchanged into
    each, with scalar expansion of what one statement leaves for the next (see the module)."""

    def __init__(self, names: Callable[[str], str], tile: Tile, mapping: dict[Expr, Expr],
                 hoist: bool = False):
        self.names, self.tile, self.width = names, tile, tile.width
        self.hoist = hoist  # per-row values out of the loops over the reduced extent, as arrays
        self.offset = sub(tile.c, tile.lo)
        self.mapping = dict(mapping)
        self.arrays: dict[Expr, str] = {}  # accumulator -> its array over the tile
        self.kept: dict[str, tuple[str, int]] = {}  # a row's kept values -> (array, rows)

    def expr(self, e: Expr) -> Expr:
        e = self._kept_loads(e)
        return substitute(e, self.mapping, {})

    def _kept_loads(self, e: Expr) -> Expr:
        """Loads of a kept row array at row i read its expansion at (i, column)."""
        if not self.kept:
            return e
        loads = {n: n for n in walk([e]) if n.op == "lload" and n.name in self.kept}
        if not loads:
            return e
        for node in loads:
            name, _ = self.kept[node.name]
            row = substitute(self._kept_loads(node.args[0]), self.mapping, {})
            loads[node] = array_load(name, node.dtype, add(mul(row, self.width), self.offset))
        return substitute(e, loads, {})

    def expand(self, scalar: Expr) -> tuple[str, Expr]:
        name = self.names("col")
        self.arrays[scalar] = name
        self.mapping[scalar] = array_load(name, scalar.dtype, self.offset)
        return name, self.mapping[scalar]

    def across(self, stmts: list[ir.Stmt]) -> ir.Loop:
        return columns_loop(self.tile.c, self.tile.lo, self.tile.hi, stmts)

    def statements(self, body: list[ir.Stmt]) -> list[ir.Stmt] | None:
        out: list[ir.Stmt] = []
        for stmt in body:
            made = self.statement(stmt)
            if made is None:
                return None
            out.extend(made)
        return out

    def statement(self, stmt: ir.Stmt) -> list[ir.Stmt] | None:
        if isinstance(stmt, (ir.DeclAcc, ir.Let)):
            scalar = stmt.acc if isinstance(stmt, ir.DeclAcc) else stmt.local
            value = self.expr(stmt.init if isinstance(stmt, ir.DeclAcc) else stmt.value)
            if isinstance(stmt, ir.Let) and value.op == "lload" and value.args[0] is self.offset:
                self.mapping[scalar] = value  # a phase's finished accumulator: no copy
                return []
            name, _ = self.expand(scalar)
            return [ir.DeclArray(name, scalar.dtype, self.width),
                    self.across([ir.ArrayStore(name, self.offset, value)])]
        if isinstance(stmt, ir.DeclArray):
            name = self.names("kept")
            self.kept[stmt.name] = (name, stmt.size)
            return [ir.DeclArray(name, stmt.dtype, stmt.size * self.width)]
        if isinstance(stmt, ir.Store):
            return [self.across([ir.Store(stmt.buffer, self.expr(stmt.offset),
                                          self.expr(stmt.value))])]
        if isinstance(stmt, ir.Loop) and not stmt.parallel:
            inner = [self.element(s) for s in stmt.body]
            if any(s is None for s in inner):
                return None
            before: list[ir.Stmt] = []
            if self.hoist:
                before, inner = self.row_values(stmt.var, inner)  # type: ignore[arg-type]
            return [*before, ir.Loop(stmt.var, self.expr(stmt.start), self.expr(stmt.stop),
                                     [self.across(inner)])]  # type: ignore[list-item]
        return None

    def row_values(self, r: Expr, inner: list[ir.Stmt]) -> tuple[list[ir.Stmt], list[ir.Stmt]]:
        """The largest sub-expressions of a loop's statements that depend on the column and not
        on the loop's variable `r` nor on what the loop writes (its accumulators): a row's mean,
        1/sqrt(variance + eps). Each is computed once per column into an array before the loop,
        which the statements read instead; left in the loop, it would be computed again for
        every element of the row (a square root and a division per element)."""
        found: dict[Expr, None] = {}
        written = {s.name for s in inner if isinstance(s, ir.ArrayStore)}  # accumulators

        def invariant(e: Expr) -> bool:
            return (r not in e.free and self.tile.c in e.free
                    and not any(n.op == "lload" and n.name in written for n in walk([e])))

        def visit(e: Expr) -> None:
            if invariant(e):
                if e.op not in ("var", "lload", "load", "const") and any(a.args for a in e.args):
                    found[e] = None
                    return
            for a in e.args:
                visit(a)

        for e in (e for s in inner for e in ir.stmt_exprs(s)):
            visit(e)
        before: list[ir.Stmt] = []
        loads: dict[Expr, Expr] = {}
        for e in found:
            name = self.names("row")
            before += [ir.DeclArray(name, e.dtype, self.width),
                       self.across([ir.ArrayStore(name, self.offset, e)])]
            loads[e] = array_load(name, e.dtype, self.offset)
        if loads:
            memo: dict[Expr, Expr] = {}
            ir.map_exprs(inner, lambda e: replace_nodes(e, loads, memo))
        return before, inner

    def element(self, stmt: ir.Stmt) -> ir.Stmt | None:
        """A statement of a loop over the reduced extent, now run for one column of the tile."""
        if isinstance(stmt, ir.Let):
            return ir.Let(stmt.local, self.expr(stmt.value))
        if isinstance(stmt, ir.Assign) and stmt.acc in self.arrays:
            return ir.ArrayStore(self.arrays[stmt.acc], self.offset, self.expr(stmt.value))
        if isinstance(stmt, ir.Store):
            return ir.Store(stmt.buffer, self.expr(stmt.offset), self.expr(stmt.value))
        if isinstance(stmt, ir.ArrayStore) and stmt.name in self.kept:
            name, _ = self.kept[stmt.name]
            row = self.expr(stmt.index)
            return ir.ArrayStore(name, add(mul(row, self.width), self.offset),
                                 self.expr(stmt.value))
        return None
