"""The loop-nest IR: statements over `Expr` scalars.

A kernel is a list of stages run one after another; a stage is a loop nest. Statements are mutable
dataclasses so that passes (loop splitting, parallel-loop choice) can rewrite them in place; the
expressions inside them are immutable interned DAGs (see `kiln.codegen.expr`).
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from kiln.codegen.expr import Expr
from kiln.codegen.microkernel import MicroKernel


# How a parallel loop's work items are shared among workers: "even" — equal shares decided up
# front (items of equal cost); "one" — one item at a time as workers free up (few, uneven items:
# GEMM cache blocks); "chunks" — small chunks (cheap, memory-bound items: a worker the OS
# deschedules on a loaded machine holds up only its chunk); "blocks" — `Loop.blocks` equal chunks
# dealt out in a fixed order, the same in every loop of a kernel (FusionStitching's stitched
# stages: chunk k of every stage runs on the same worker).
GRAINS = ("even", "one", "chunks", "blocks")


@dataclass(eq=False)
class Loop:
    """for var in [start, stop): body. The IR says what may run in parallel, a backend says how
    (`kiln.codegen.backend`): `parallel` > 0 makes the iterations of this loop and of the
    `parallel - 1` loops perfectly nested in it independent work items, shared out by `grain`
    (see GRAINS); `simd` marks a vectorisable inner loop and `reductions` its (operator,
    accumulator) reductions."""

    var: Expr
    start: Expr
    stop: Expr
    body: list[Stmt]
    parallel: int = 0
    simd: bool = False
    reductions: tuple[tuple[str, Expr], ...] = ()
    grain: str = "even"  # of a parallel loop: one of GRAINS
    blocks: int = 0  # chunks of the "blocks" grain
    # of a parallel loop on a GPU: its iterations are work-items in work-groups of this many
    # consecutive ones, which share the loop body's local arrays and meet at its barriers (0: the
    # backend groups them as it likes, and the body has neither)
    work_group: int = 0

    @property
    def static_extent(self) -> int | None:
        if self.start.is_const and self.stop.is_const:
            return max(0, self.stop.value - self.start.value)
        return None


@dataclass(eq=False)
class Let:
    """An immutable named scalar: `const T local = value;`."""

    local: Expr
    value: Expr


@dataclass(eq=False)
class DeclAcc:
    """A mutable scalar: `T acc = init;`."""

    acc: Expr
    init: Expr


@dataclass(eq=False)
class Assign:
    """`acc = value;` for a mutable scalar."""

    acc: Expr
    value: Expr


@dataclass(eq=False)
class DeclArray:
    """A local (stack) array `T name[size];`; with scope "group", one array per work-group of
    the enclosing `Loop.work_group` loop, shared by its work-items (a GPU's local/shared memory)."""

    name: str
    dtype: str
    size: int
    scope: str = "private"  # or "group"


@dataclass(eq=False)
class Barrier:
    """Every work-item of the work-group waits here until all have arrived, and then sees what
    the others stored to the group's arrays before it (`DeclArray.scope == "group"`)."""


@dataclass(eq=False)
class ArrayStore:
    name: str
    index: Expr
    value: Expr


@dataclass(eq=False)
class Store:
    """`buffer[offset] = value;` into a kernel buffer."""

    buffer: str
    offset: Expr
    value: Expr


@dataclass(eq=False)
class If:
    cond: Expr
    body: list[Stmt]
    orelse: list[Stmt] = field(default_factory=list)


@dataclass(eq=False)
class MicroKernelCall:
    """One register-blocked GEMM tile update (`kiln.codegen.microkernel`):
    `kernel(kc, a + a_offset, b + b_offset, ldb, c + c_offset, ldc, accumulate)`. `a` and `b` are
    kernel buffers (packed weights or scratch), `c` a local array. An indirect kernel takes the
    row-offset table `rows + rows_offset` (a kernel buffer of int32) in place of `ldb`. A kernel
    with a tile epilogue also takes `operands` (buffer, offset of the tile's first element) and
    applies it when `finish` holds (after the last slice of the sum); one that spreads its
    requests for B's next slice (`MicroKernel.b_spread`) takes `ahead` after `accumulate`."""

    kernel: MicroKernel
    kc: Expr
    a: str
    a_offset: Expr
    b: str
    b_offset: Expr
    ldb: int
    c: str
    c_offset: Expr
    ldc: int
    accumulate: Expr
    rows: str | None = None
    rows_offset: Expr | None = None
    operands: tuple[tuple[str, Expr], ...] = ()
    finish: Expr | None = None
    ahead: tuple[str, Expr] | None = None  # (buffer, offset) of a `b_spread` kernel's share

    @property
    def buffers(self) -> tuple[str, ...]:
        """The names of every buffer and local array the call passes."""
        return (self.a, self.b, self.c, *((self.rows,) if self.rows else ()),
                *((self.ahead[0],) if self.ahead else ()),
                *(name for name, _ in self.operands))


@dataclass(eq=False)
class Transpose:
    """dst[dst_offset + c·ldd + r] = src[src_offset + r·lds + c] for r < rows, c < cols: a block
    of one local array copied transposed into another, through vector registers
    (`kiln.codegen.microkernel.transpose_source`, vectors of `vector_bytes`)."""

    dtype: str
    src: str
    src_offset: Expr
    lds: int
    dst: str
    dst_offset: Expr
    ldd: int
    rows: Expr
    cols: Expr
    vector_bytes: int

    @property
    def buffers(self) -> tuple[str, ...]:
        """The names of the buffers and local arrays the call passes."""
        return (self.src, self.dst)


Stmt = (Loop | Let | DeclAcc | Assign | DeclArray | ArrayStore | Store | If | MicroKernelCall
        | Transpose | Barrier)


@dataclass(eq=False)
class Stage:
    """One loop nest of a kernel, with a comment naming what it computes (Kiln's names only)."""

    comment: str
    body: list[Stmt]


@dataclass(frozen=True)
class Buffer:
    """A pointer the kernel uses: an argument (input/output) or a region of the scratch memory."""

    name: str  # C identifier: a tensor id (t12) or a derived-constant name (k3_d0)
    dtype: str
    role: str  # "input", "output" or "scratch"
    scratch_offset: int = 0


@dataclass
class KernelIR:
    symbol: str
    buffers: list[Buffer]
    stages: list[Stage]
    scratch_bytes: int = 0


def children(stmt: Stmt) -> list[list[Stmt]]:
    if isinstance(stmt, Loop):
        return [stmt.body]
    if isinstance(stmt, If):
        return [stmt.body, stmt.orelse]
    return []


def iter_stmts(body: list[Stmt]) -> Iterator[Stmt]:
    """Every statement in `body`, parents before children."""
    for stmt in body:
        yield stmt
        for block in children(stmt):
            yield from iter_stmts(block)


def stmt_exprs(stmt: Stmt) -> list[Expr]:
    """The expressions a statement itself uses (not those of nested statements)."""
    if isinstance(stmt, Loop):
        return [stmt.start, stmt.stop]
    if isinstance(stmt, Let):
        return [stmt.value]
    if isinstance(stmt, (DeclAcc,)):
        return [stmt.init]
    if isinstance(stmt, Assign):
        return [stmt.value]
    if isinstance(stmt, ArrayStore):
        return [stmt.index, stmt.value]
    if isinstance(stmt, Store):
        return [stmt.offset, stmt.value]
    if isinstance(stmt, If):
        return [stmt.cond]
    if isinstance(stmt, MicroKernelCall):
        exprs = [stmt.kc, stmt.a_offset, stmt.b_offset, stmt.c_offset, stmt.accumulate]
        exprs += [offset for _, offset in stmt.operands]
        exprs += [stmt.finish] if stmt.finish is not None else []
        exprs += [stmt.ahead[1]] if stmt.ahead is not None else []
        return exprs + ([stmt.rows_offset] if stmt.rows_offset is not None else [])
    if isinstance(stmt, Transpose):
        return [stmt.src_offset, stmt.dst_offset, stmt.rows, stmt.cols]
    return []


def map_exprs(body: list[Stmt], fn) -> None:
    """Replace every expression in `body` (nested statements included) by `fn(expr)`, in place."""
    for stmt in iter_stmts(body):
        if isinstance(stmt, Loop):
            stmt.start, stmt.stop = fn(stmt.start), fn(stmt.stop)
        elif isinstance(stmt, Let):
            stmt.value = fn(stmt.value)
        elif isinstance(stmt, DeclAcc):
            stmt.init = fn(stmt.init)
        elif isinstance(stmt, Assign):
            stmt.value = fn(stmt.value)
        elif isinstance(stmt, ArrayStore):
            stmt.index, stmt.value = fn(stmt.index), fn(stmt.value)
        elif isinstance(stmt, Store):
            stmt.offset, stmt.value = fn(stmt.offset), fn(stmt.value)
        elif isinstance(stmt, If):
            stmt.cond = fn(stmt.cond)
        elif isinstance(stmt, MicroKernelCall):
            stmt.kc, stmt.accumulate = fn(stmt.kc), fn(stmt.accumulate)
            stmt.a_offset, stmt.b_offset = fn(stmt.a_offset), fn(stmt.b_offset)
            stmt.c_offset = fn(stmt.c_offset)
            stmt.operands = tuple((name, fn(offset)) for name, offset in stmt.operands)
            if stmt.finish is not None:
                stmt.finish = fn(stmt.finish)
            if stmt.rows_offset is not None:
                stmt.rows_offset = fn(stmt.rows_offset)
            if stmt.ahead is not None:
                stmt.ahead = (stmt.ahead[0], fn(stmt.ahead[1]))
        elif isinstance(stmt, Transpose):
            stmt.src_offset, stmt.dst_offset = fn(stmt.src_offset), fn(stmt.dst_offset)
            stmt.rows, stmt.cols = fn(stmt.rows), fn(stmt.cols)


def all_exprs(body: list[Stmt]) -> list[Expr]:
    return [e for stmt in iter_stmts(body) for e in stmt_exprs(stmt)]
