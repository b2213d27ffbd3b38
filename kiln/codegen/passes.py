"""Loop-nest passes run on every stage: loop splitting and the choice of parallel loops.

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
"""
from __future__ import annotations

import math
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
    mul,
    rebuild,
    sub,
    substitute,
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
