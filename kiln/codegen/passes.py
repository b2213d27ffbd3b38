"""Loop-nest passes: loop splitting and the choice of parallel loops (every stage, `finish_stage`),
then common sub-expressions and loop-invariant code motion (every kernel, `bind_values`).

Loop splitting strength-reduces index maps: when the innermost loop's variable `j` appears as
`j // c` or `j % c` with `c` dividing its extent, the loop becomes two loops over `(j1, j0)` with
`j = j1·c + j0`, and the simplifier turns `j // c` into `j1` and `j % c` into `j0`. A Transpose or a
broadcast read inside a flat elementwise loop thus becomes a plain affine nest with no division
left in the inner loop (it iterates the output in its natural order and the input offset is an
affine function of the loop variables, which the C compiler strength-reduces to increments).

Index-set splitting removes the comparisons and clamps a Pad, Concat or border read leaves on an
inner vectorised loop's variable (`i < 112`, `min(i, 111)`, `i >= 3`) when the point where they
change is a constant: the loop becomes consecutive loops over sub-ranges, and in each the
simplifier decides the conditions from the variable's narrower range. The loads become
contiguous (no clamp, so no gather) and the select disappears. A select left on a condition the
inner loop does not change (a padded row) is unswitched: one loop per outcome under an `if`.

Value binding gives every expression node worth a name a `Let` of a temporary (`v0`, `v1`, ...),
once per scope (common sub-expressions), at the outermost loop level where every variable it reads
is defined (loop-invariant code motion): a bias load `b[c]` sits in the channel loop, not in the
pixel loop. Nodes that read mutable state (accumulators, local arrays, buffers the stage itself
writes) are bound where they are used and shared only until that state is written. `if` bodies
are barriers: nothing computed under a condition moves above it. After it, every expression in
the kernel is a small tree over constants, variables and named values, which a renderer prints
as it stands.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from kiln.codegen import ir
from kiln.codegen.expr import (
    BOOL,
    INDEX,
    Expr,
    add,
    const,
    iconst,
    make,
    mul,
    rebuild,
    sub,
    substitute,
    temporary,
    var,
    walk,
)
from kiln.codegen.schedule import Schedule

MAX_SPLITS_PER_LOOP = 8
MAX_INDEX_SET_PIECES = 5
CONDITIONS = frozenset({"lt", "le", "gt", "ge", "eq", "ne", "min", "max"})


def finish_stage(body: list[ir.Stmt], work: int, schedule: Schedule,
                 names: Callable[[str], str]) -> None:
    body[:] = drop_unit_loops(body)
    if schedule.split_loops:
        for stmt in list(ir.iter_stmts(body)):
            if isinstance(stmt, ir.Loop) and _innermost(stmt):
                _split(stmt, names)
        body[:] = drop_unit_loops(split_index_sets(body, names))
    for stmt in body:
        if isinstance(stmt, ir.Loop) and stmt.parallel:
            if work < schedule.parallel_min_work:
                stmt.parallel = 0
            else:
                stmt.parallel = _collapse_depth(stmt, schedule.parallel_min_iterations)
                if schedule.stitch_blocks > 0 and stmt.grain == "chunks":
                    stmt.grain, stmt.blocks = "blocks", schedule.stitch_blocks


def drop_unit_loops(body: list[ir.Stmt]) -> list[ir.Stmt]:
    """Replace loops that run exactly once by their body with the variable fixed."""
    result: list[ir.Stmt] = []
    for stmt in body:
        for block in ir.children(stmt):
            block[:] = drop_unit_loops(block)
        if isinstance(stmt, ir.Loop) and stmt.static_extent == 1:
            ir.map_exprs(stmt.body, _substitution({stmt.var: stmt.start}))
            result.extend(stmt.body)
        else:
            result.append(stmt)
    return result


def _substitution(mapping: dict[Expr, Expr]) -> Callable[[Expr], Expr]:
    memo: dict[Expr, Expr] = {}
    return lambda e: substitute(e, mapping, memo)


def _innermost(loop: ir.Loop) -> bool:
    return not any(isinstance(s, ir.Loop) for s in ir.iter_stmts(loop.body))


def _split(loop: ir.Loop, names: Callable[[str], str]) -> None:
    for _ in range(MAX_SPLITS_PER_LOOP):
        extent = loop.static_extent
        if extent is None or not loop.start.is_const or loop.start.value != 0:
            return
        factor = _split_factor(loop, extent)
        if factor is None:
            return
        base = loop.var.name.rstrip("0123456789")
        outer, inner_var = var(names(base), extent // factor), var(names(base), factor)
        ir.map_exprs(loop.body, _substitution({loop.var: add(mul(outer, factor), inner_var)}))
        inner = ir.Loop(inner_var, iconst(0), iconst(factor), loop.body, simd=loop.simd,
                        reductions=loop.reductions)
        loop.var, loop.stop, loop.body = outer, iconst(extent // factor), [inner]
        loop.simd, loop.reductions = False, ()
        loop = inner


def _split_factor(loop: ir.Loop, extent: int) -> int | None:
    factors = {node.attr for node in walk(ir.all_exprs(loop.body))
               if node.op in ("fdiv", "fmod") and node.args[0] is loop.var
               and 1 < node.attr < extent and extent % node.attr == 0}
    return max(factors) if factors else None


def _collapse_depth(loop: ir.Loop, min_iterations: int) -> int:
    depth, product, current = 1, loop.static_extent or min_iterations, loop
    while (product < min_iterations and not current.simd and len(current.body) == 1
           and isinstance(current.body[0], ir.Loop) and current.body[0].static_extent
           and not current.body[0].simd and current.body[0].start.is_const):
        current = current.body[0]
        product *= current.static_extent
        depth += 1
    return depth


def split_index_sets(body: list[ir.Stmt], names: Callable[[str], str]) -> list[ir.Stmt]:
    """Index-set splitting of the inner vectorised loops of `body` (see the module docstring)."""
    result: list[ir.Stmt] = []
    for stmt in body:
        for block in ir.children(stmt):
            block[:] = split_index_sets(block, names)
        if (isinstance(stmt, ir.Loop) and stmt.simd and not stmt.parallel and _innermost(stmt)
                and stmt.start.is_const and stmt.stop.is_const):
            result.extend(_unswitch(piece) for piece in _index_set_pieces(stmt, names))
        else:
            result.append(stmt)
    return result


def _affine(e: Expr, v: Expr) -> tuple[int, int] | None:
    """(k, c) with e = k·v + c, or None."""
    if e is v:
        return 1, 0
    if e.op == "sum" and e.args == (v,):
        return e.attr[0][0], e.attr[1]
    return None


def _sign_change(k: int, c: int) -> int:
    """The first integer v at which `k·v + c < 0` differs from its value at v - 1."""
    return -(c // k) if k > 0 else c // (-k) + 1


def _breakpoints(v: Expr, lo: int, hi: int, body: list[ir.Stmt]) -> set[int]:
    """Constant points inside (lo, hi) where a comparison or clamp of `v` may change."""
    strict: set[int] = set()
    either: list[tuple[int, int]] = []  # clamps: ties give the same value, either point will do
    for node in walk(ir.all_exprs(body)):
        if (node.op not in CONDITIONS or len(node.args) != 2
                or node.args[0].dtype != INDEX or node.args[1].dtype != INDEX):
            continue
        kc = _affine(sub(node.args[0], node.args[1]), v)
        if kc is None:
            continue
        k, c = kc
        forms = {"lt": [(k, c)], "le": [(k, c - 1)], "gt": [(-k, -c)], "ge": [(-k, -c - 1)],
                 "eq": [(k, c), (-k, -c)], "ne": [(k, c), (-k, -c)]}.get(node.op)
        if forms is None:
            either.append((_sign_change(k, c), _sign_change(k, c - 1)))
        else:
            strict |= {_sign_change(kk, cc) for kk, cc in forms}
    points = {p for p in strict if lo < p < hi}
    for a, b in either:
        if not {a, b} & (points | {lo, hi}) and (lo < a < hi or lo < b < hi):
            points.add(a if lo < a < hi else b)
    return points


def _index_set_pieces(loop: ir.Loop, names: Callable[[str], str]) -> list[ir.Stmt]:
    """The loop as consecutive loops over sub-ranges, splitting again inside a piece where a
    nested clamp has become decidable; the loop itself when there is nothing to split or the
    pieces would be too many."""
    lo, hi = loop.start.value, loop.stop.value
    pieces: list[tuple[int, int, Expr, list[ir.Stmt]]] = [(lo, hi, loop.var, loop.body)]
    for _ in range(MAX_INDEX_SET_PIECES):
        refined: list[tuple[int, int, Expr, list[ir.Stmt]]] = []
        for a, b, v, body in pieces:
            points = sorted(_breakpoints(v, a, b, body))
            if not points:
                refined.append((a, b, v, body))
                continue
            bounds = [a, *points, b]
            base = loop.var.name.rstrip("0123456789")
            for pa, pb in zip(bounds, bounds[1:]):
                piece_var = var(names(base), pb - pa, pa)
                copy = _clone(body)
                ir.map_exprs(copy, _substitution({v: piece_var}))
                refined.append((pa, pb, piece_var, copy))
        if len(refined) > MAX_INDEX_SET_PIECES:
            return [loop]
        if len(refined) == len(pieces):
            break
        pieces = refined
    if len(pieces) == 1:
        return [loop]
    return [replace(loop, var=v, start=iconst(a), stop=iconst(b), body=body)
            for a, b, v, body in pieces]


def _unswitch(loop: ir.Stmt) -> ir.Stmt:
    """An inner loop selecting by a condition that does not depend on its variable (a padded row
    of a Pad, say) becomes `if (cond) loop-with-the-first-value else loop-with-the-second`:
    gcc keeps such a select as a branch around the arm's arithmetic on AVX2 and NEON, and the
    loop would not vectorise."""
    if not isinstance(loop, ir.Loop):
        return loop
    for node in walk(ir.all_exprs(loop.body)):
        if node.op != "select":
            continue
        cond = node.args[0]
        if cond.is_const or loop.var in cond.free or any(
                n.op in ("load", "lload", "acc", "local") for n in walk([cond])):
            continue
        versions = []
        for value in (True, False):
            body = _clone(loop.body)
            ir.map_exprs(body, _replacing(cond, const(value, BOOL)))
            versions.append(replace(loop, body=body))
        return ir.If(cond, [_unswitch(versions[0])], [_unswitch(versions[1])])
    return loop


def _replacing(target: Expr, value: Expr) -> Callable[[Expr], Expr]:
    """Replace the node `target` (any node, not only a variable) by `value`, simplifying."""
    memo: dict[Expr, Expr] = {}

    def go(e: Expr) -> Expr:
        if e is target:
            return value
        found = memo.get(e)
        if found is None:
            args = tuple(go(a) for a in e.args)
            found = e if all(a is b for a, b in zip(args, e.args)) else rebuild(e, args)
            memo[e] = found
        return found
    return go


def _clone(body: list[ir.Stmt]) -> list[ir.Stmt]:
    """A copy of the statements (expressions are immutable and shared)."""
    copies: list[ir.Stmt] = []
    for stmt in body:
        if isinstance(stmt, ir.Loop):
            copies.append(replace(stmt, body=_clone(stmt.body)))
        elif isinstance(stmt, ir.If):
            copies.append(replace(stmt, body=_clone(stmt.body), orelse=_clone(stmt.orelse)))
        else:
            copies.append(replace(stmt))
    return copies


# ---------------------------------------------------------------------------------------------
# Value binding: common sub-expressions and loop-invariant code motion

def bind_values(kernel: ir.KernelIR) -> None:
    """Bind the expressions of every stage of `kernel` to temporaries (see the module docstring),
    in place; temporaries are numbered across the kernel."""
    binder = _Binder()
    for stage in kernel.stages:
        stage.body = binder.stage(stage.body)


class _Scope:
    def __init__(self, parent: _Scope | None, defines: set[Expr], barrier: bool = False):
        self.parent = parent
        self.defines = defines
        self.barrier = barrier
        self.body: list[ir.Stmt] = []
        self.names: dict[Expr, Expr] = {}
        # temporaries of values that read mutable state, valid until that state is written
        self.mutable: dict[Expr, Expr] = {}

    def written(self, names: set[str], depends: dict[Expr, frozenset[str]]) -> None:
        """State `names` changed: forget the temporaries that read it."""
        for e in [e for e in self.mutable if depends[e] & names]:
            del self.mutable[e]

    def lookup(self, e: Expr) -> Expr | None:
        scope: _Scope | None = self
        while scope is not None:
            if e in scope.names:
                return scope.names[e]
            scope = scope.parent
        return None


class _Binder:
    def __init__(self) -> None:
        self.counter = 0
        self.written: set[str] = set()  # buffers the current stage stores to
        self.depends: dict[Expr, frozenset[str]] = {}  # the mutable state each node reads

    def stage(self, body: list[ir.Stmt]) -> list[ir.Stmt]:
        self.written = ({s.buffer for s in ir.iter_stmts(body) if isinstance(s, ir.Store)}
                        | {s.c for s in ir.iter_stmts(body) if isinstance(s, ir.MicroKernelCall)})
        self.depends = {}
        scope = _Scope(None, set(), barrier=True)
        for stmt in body:
            self.statement(stmt, scope)
        return scope.body

    def statement(self, stmt: ir.Stmt, scope: _Scope) -> None:
        self._bind(stmt, scope)
        changed = writes(stmt)
        if changed:
            scope.written(changed, self.depends)

    def _bind(self, stmt: ir.Stmt, scope: _Scope) -> None:
        ref = self.ref
        if isinstance(stmt, ir.Loop):
            self.loop(stmt, scope)
        elif isinstance(stmt, ir.Let):
            scope.body.append(ir.Let(stmt.local, ref(stmt.value, scope)))
            scope.defines.add(stmt.local)
        elif isinstance(stmt, ir.DeclAcc):
            scope.body.append(ir.DeclAcc(stmt.acc, ref(stmt.init, scope)))
            scope.defines.add(stmt.acc)
        elif isinstance(stmt, ir.Assign):
            scope.body.append(ir.Assign(stmt.acc, ref(stmt.value, scope)))
        elif isinstance(stmt, (ir.DeclArray, ir.Barrier)):
            scope.body.append(stmt)
        elif isinstance(stmt, ir.ArrayStore):
            index = ref(stmt.index, scope)
            scope.body.append(ir.ArrayStore(stmt.name, index, ref(stmt.value, scope)))
        elif isinstance(stmt, ir.Store):
            offset = ref(stmt.offset, scope)
            scope.body.append(ir.Store(stmt.buffer, offset, ref(stmt.value, scope)))
        elif isinstance(stmt, ir.If):
            self.branch(stmt, scope)
        elif isinstance(stmt, ir.MicroKernelCall):
            kc, accumulate = ref(stmt.kc, scope), ref(stmt.accumulate, scope)
            a, b, c = (ref(stmt.a_offset, scope), ref(stmt.b_offset, scope),
                       ref(stmt.c_offset, scope))
            rows = None if stmt.rows_offset is None else ref(stmt.rows_offset, scope)
            operands = tuple((name, ref(offset, scope)) for name, offset in stmt.operands)
            finish = None if stmt.finish is None else ref(stmt.finish, scope)
            ahead = None if stmt.ahead is None else (stmt.ahead[0], ref(stmt.ahead[1], scope))
            scope.body.append(replace(stmt, kc=kc, accumulate=accumulate, a_offset=a,
                                      b_offset=b, c_offset=c, rows_offset=rows,
                                      operands=operands, finish=finish, ahead=ahead))
        elif isinstance(stmt, ir.Transpose):
            scope.body.append(replace(stmt, src_offset=ref(stmt.src_offset, scope),
                                      dst_offset=ref(stmt.dst_offset, scope),
                                      rows=ref(stmt.rows, scope), cols=ref(stmt.cols, scope)))
        else:
            raise TypeError(f"unknown statement {stmt!r}")

    def loop(self, loop: ir.Loop, scope: _Scope) -> None:
        """A loop (with the loops a parallel nest collapses): bounds bound outside, body inside."""
        nest = [loop]
        for _ in range(loop.parallel - 1):
            inner = nest[-1].body
            assert len(inner) == 1 and isinstance(inner[0], ir.Loop), "collapse needs a perfect nest"
            nest.append(inner[0])
        bounds = [(self.ref(level.start, scope), self.ref(level.stop, scope)) for level in nest]
        child = _Scope(scope, {level.var for level in nest})
        for stmt in nest[-1].body:
            self.statement(stmt, child)
        body = child.body
        for level, (start, stop) in reversed(list(zip(nest, bounds))):
            body = [replace(level, start=start, stop=stop, body=body)]
        scope.body.extend(body)

    def branch(self, stmt: ir.If, scope: _Scope) -> None:
        cond = self.ref(stmt.cond, scope)
        then = _Scope(scope, set(), barrier=True)
        for s in stmt.body:
            self.statement(s, then)
        other = _Scope(scope, set(), barrier=True)
        for s in stmt.orelse:
            self.statement(s, other)
        scope.body.append(ir.If(cond, then.body, other.body))

    def ref(self, e: Expr, scope: _Scope) -> Expr:
        """`e` as it is used at `scope`: a constant, a variable, a temporary bound where it
        belongs, or (not worth a name) a node over such references."""
        if e.op in ("const", "var", "local", "acc"):
            return e
        if self._state_read(e):
            return self._mutable_ref(e, scope)
        known = scope.lookup(e)
        if known is not None:
            return known
        target = self._placement(e, scope)
        value = make(e.op, e.dtype, tuple(self.ref(a, target) for a in e.args), e.attr)
        if e.op == "sum" and len(e.args) == 1 and e.attr[1] == 0:
            return value  # k*x: not worth a name
        name = self._temporary(e)
        target.body.append(ir.Let(name, value))
        target.names[e] = name
        return name

    def _mutable_ref(self, e: Expr, scope: _Scope) -> Expr:
        """Nodes reading mutable state: bound where used (never hoisted), shared by the
        statements of the same scope until the state they read is written."""
        if e in scope.mutable:
            return scope.mutable[e]
        value = make(e.op, e.dtype, tuple(self.ref(a, scope) for a in e.args), e.attr)
        if e.op in ("lload", "load"):
            return value
        name = self._temporary(e)
        scope.body.append(ir.Let(name, value))
        scope.mutable[e] = name
        return name

    def _temporary(self, e: Expr) -> Expr:
        name = temporary(f"v{self.counter}", e)
        self.counter += 1
        return name

    def _state_read(self, e: Expr) -> frozenset[str]:
        """Names of the mutable state (accumulators, local arrays, buffers this stage writes)
        that `e` reads."""
        known = self.depends.get(e)
        if known is None:
            own = {e.name} if (e.op in ("acc", "lload")
                               or (e.op == "load" and e.name in self.written)) else set()
            known = frozenset(own).union(*(self._state_read(a) for a in e.args))
            self.depends[e] = known
        return known

    def _placement(self, e: Expr, scope: _Scope) -> _Scope:
        free = e.free
        while (scope.parent is not None and not scope.barrier
               and not (scope.defines & free)):
            scope = scope.parent
        return scope


def writes(stmt: ir.Stmt) -> set[str]:
    """Names of the mutable state a statement (with its nested statements) writes."""
    names = set()
    for s in ir.iter_stmts([stmt]):
        if isinstance(s, (ir.Assign, ir.DeclAcc)):
            names.add(s.acc.name)
        elif isinstance(s, ir.ArrayStore):
            names.add(s.name)
        elif isinstance(s, ir.Store):
            names.add(s.buffer)
        elif isinstance(s, ir.MicroKernelCall):
            names.add(s.c)
        elif isinstance(s, ir.Transpose):
            names.add(s.dst)
    return names
