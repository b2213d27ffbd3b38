"""Loop-nest passes run on every stage: loop splitting and the choice of parallel loops.

Loop splitting strength-reduces index maps: when the innermost loop's variable `j` appears as
`j // c` or `j % c` with `c` dividing its extent, the loop becomes two loops over `(j1, j0)` with
`j = j1·c + j0`, and the simplifier turns `j // c` into `j1` and `j % c` into `j0`. A Transpose or a
broadcast read inside a flat elementwise loop thus becomes a plain affine nest with no division
left in the inner loop (it iterates the output in its natural order and the input offset is an
affine function of the loop variables, which the C compiler strength-reduces to increments).
"""
from __future__ import annotations

from collections.abc import Callable

from kiln.codegen import ir
from kiln.codegen.expr import Expr, add, iconst, mul, substitute, var, walk
from kiln.codegen.schedule import Schedule

MAX_SPLITS_PER_LOOP = 8


def finish_stage(body: list[ir.Stmt], work: int, schedule: Schedule,
                 names: Callable[[str], str]) -> None:
    body[:] = drop_unit_loops(body)
    if schedule.split_loops:
        for stmt in list(ir.iter_stmts(body)):
            if isinstance(stmt, ir.Loop) and _innermost(stmt):
                _split(stmt, names)
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
