"""Contraction ops: MatMul (batched, broadcast batch dims), Gemm, and Einsum in matrix form (a
generic loop nest otherwise), each a `Contraction` for the GEMM code in `kiln.codegen.gemm`."""
from __future__ import annotations

import math

import numpy as np

from kiln.codegen import ir
from kiln.codegen.contexts import StageCtx
from kiln.codegen.expr import (
    Expr,
    acc,
    add,
    binary,
    const,
    iconst,
    mul,
)
from kiln.codegen.gemm.contraction import contraction
from kiln.codegen.gemm.spec import Contraction
from kiln.codegen.indexing import Index, broadcast
from kiln.codegen.ops.registry import stage


def _identity_finish(total: Expr, b: Expr, i: Expr, j: Expr) -> Expr:
    return total


def matmul_dims(a_shape: tuple[int, ...], b_shape: tuple[int, ...]
                ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """MatMul's operands as stacks of matrices (a 1-D operand gains its unit dim) and the batch
    shape they broadcast to."""
    a2 = (1, *a_shape) if len(a_shape) == 1 else a_shape
    b2 = (*b_shape, 1) if len(b_shape) == 1 else b_shape
    return a2, b2, tuple(np.broadcast_shapes(a2[:-2], b2[:-2]))


def matmul_spec(ctx: StageCtx) -> Contraction:
    a_shape, b_shape = ctx.tensor(0).shape, ctx.tensor(1).shape
    a2, b2, batch = matmul_dims(a_shape, b_shape)
    m, k, n = a2[-2], a2[-1], b2[-1]
    out_shape = ctx.out().shape

    def a_at(bi: Index, i: Expr, kk: Expr) -> Expr:
        return ctx.operand(0, Index(a2, dims=[*bi.dims, i, kk]).reshaped(a_shape))

    def b_at(bi: Index, kk: Expr, j: Expr) -> Expr:
        return ctx.operand(1, Index(b2, dims=[*bi.dims, kk, j]).reshaped(b_shape))

    def out(b: Expr, i: Expr, j: Expr) -> Index:
        return Index(out_shape, flat=add(mul(add(mul(b, m), i), n), j))

    return Contraction(batch, m, n, k, a2[:-2], b2[:-2], a_at, b_at, out, _identity_finish,
                       ctx.out().dtype)


def gemm_spec(ctx: StageCtx) -> Contraction:
    a_shape, b_shape = ctx.tensor(0).shape, ctx.tensor(1).shape
    trans_a, trans_b = ctx.attr("transA", 0), ctx.attr("transB", 0)
    m, k = (a_shape[1], a_shape[0]) if trans_a else a_shape
    n = b_shape[0] if trans_b else b_shape[1]
    alpha, beta = float(ctx.attr("alpha", 1.0)), float(ctx.attr("beta", 1.0))
    dtype = ctx.out().dtype

    def a_at(_: Index, i: Expr, kk: Expr) -> Expr:
        return ctx.operand(0, Index(a_shape, dims=[kk, i] if trans_a else [i, kk]))

    def b_at(_: Index, kk: Expr, j: Expr) -> Expr:
        return ctx.operand(1, Index(b_shape, dims=[j, kk] if trans_b else [kk, j]))

    def out(_: Expr, i: Expr, j: Expr) -> Index:
        return Index((m, n), dims=[i, j])

    def finish(total: Expr, _: Expr, i: Expr, j: Expr) -> Expr:
        result = total if alpha == 1 else binary("mul", const(alpha, dtype), total)
        if ctx.has(2) and beta != 0:
            c = ctx.operand(2, broadcast(Index((m, n), dims=[i, j]), ctx.tensor(2).shape))
            result = binary("add", result, c if beta == 1 else binary("mul", const(beta, dtype), c))
        return result

    return Contraction((), m, n, k, (), (), a_at, b_at, out, finish, dtype)


MATRIX_SPECS = {"MatMul": matmul_spec, "Gemm": gemm_spec}  # the contractions of two matrices


@stage("MatMul")
def _matmul(ctx: StageCtx) -> None:
    contraction(ctx, matmul_spec(ctx))


@stage("Gemm")
def _gemm(ctx: StageCtx) -> None:
    contraction(ctx, gemm_spec(ctx))


def einsum_terms(equation: str, shapes: list[tuple[int, ...]]) -> tuple[list[str], str]:
    """Operand and output subscripts with `...` replaced by private letters (one per broadcast
    dim, right-aligned across operands); the implicit output is every letter used once, sorted."""
    lhs, arrow, rhs = equation.replace(" ", "").partition("->")
    terms = lhs.split(",")
    widths = [len(s) - (len(t) - 3) if "..." in t else 0 for t, s in zip(terms, shapes)]
    width = max(widths, default=0)
    hidden = [chr(0x100 + i) for i in range(width)]
    expanded = [t.replace("...", "".join(hidden[width - w:])) for t, w in zip(terms, widths)]
    if arrow:
        output = rhs.replace("...", "".join(hidden))
    else:
        counts = {ch: sum(t.count(ch) for t in expanded) for t in expanded for ch in t}
        named = sorted(ch for ch, n in counts.items() if n == 1 and ch not in hidden)
        output = "".join(hidden) + "".join(named)
    return expanded, output


def _einsum_check(op, graph) -> str | None:
    shapes = [graph.tensors[t].shape for t in op.present_inputs()]
    try:
        terms, _ = einsum_terms(op.attrs["equation"], shapes)
    except (KeyError, ValueError):
        return "unreadable equation"
    if any(len(t) != len(s) for t, s in zip(terms, shapes)):
        return "equation does not match the operand ranks"
    return None


def _letter_sizes(terms: list[str], shapes: list[tuple[int, ...]]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for term, shape in zip(terms, shapes):
        for letter, n in zip(term, shape):
            sizes[letter] = max(sizes.get(letter, 1), n)
    return sizes


def _operand_index(term: str, shape: tuple[int, ...], values: dict[str, Expr]) -> Index:
    return Index(shape, dims=[values[ch] if n > 1 else iconst(0) for ch, n in zip(term, shape)])


@stage("Einsum", check=_einsum_check)
def _einsum(ctx: StageCtx) -> None:
    operands = list(range(len(ctx.op.inputs)))
    shapes = [ctx.tensor(i).shape for i in operands]
    terms, output = einsum_terms(ctx.attr("equation"), shapes)
    sizes = _letter_sizes(terms, shapes)
    if len(terms) == 2 and _matrix_form(ctx, terms, output, shapes, sizes):
        return
    _generic_einsum(ctx, terms, output, shapes, sizes)


def _matrix_form(ctx: StageCtx, terms: list[str], output: str, shapes, sizes) -> bool:
    a, b = terms
    if len(set(a)) != len(a) or len(set(b)) != len(b) or len(set(output)) != len(output):
        return False
    if any(n != sizes[ch] for t, s in zip(terms, shapes) for ch, n in zip(t, s)):
        return False  # broadcast size-1 dims: the generic nest handles them
    if any(ch not in output and ch not in (b if ch in a else a) for ch in a + b):
        return False  # a letter summed within one operand
    batch = [ch for ch in output if ch in a and ch in b]
    m_letters = [ch for ch in a if ch in output and ch not in b]
    n_letters = [ch for ch in b if ch in output and ch not in a]
    k_letters = [ch for ch in a if ch in b and ch not in output]
    batch_shape = tuple(sizes[ch] for ch in batch)
    m_shape, n_shape = tuple(sizes[ch] for ch in m_letters), tuple(sizes[ch] for ch in n_letters)
    k_shape = tuple(sizes[ch] for ch in k_letters)
    out_shape = ctx.out().shape

    def letters(bi: Index, names, flat: Expr, shape) -> dict[str, Expr]:
        values = dict(zip(batch, bi.dims))
        values.update(zip(names, Index(shape, flat=flat).dims))
        return values

    def a_at(bi: Index, i: Expr, k: Expr) -> Expr:
        values = letters(bi, m_letters, i, m_shape)
        values.update(zip(k_letters, Index(k_shape, flat=k).dims))
        return ctx.operand(0, _operand_index(a, shapes[0], values))

    def b_at(bi: Index, k: Expr, j: Expr) -> Expr:
        values = letters(bi, n_letters, j, n_shape)
        values.update(zip(k_letters, Index(k_shape, flat=k).dims))
        return ctx.operand(1, _operand_index(b, shapes[1], values))

    def out(bf: Expr, i: Expr, j: Expr) -> Index:
        values = letters(Index(batch_shape, flat=bf), m_letters, i, m_shape)
        values.update(zip(n_letters, Index(n_shape, flat=j).dims))
        return _operand_index(output, out_shape, values)

    contraction(ctx, Contraction(batch_shape, math.prod(m_shape), math.prod(n_shape),
                                 math.prod(k_shape), batch_shape, batch_shape, a_at, b_at, out,
                                 _identity_finish, ctx.out().dtype))
    return True


def _generic_einsum(ctx: StageCtx, terms: list[str], output: str, shapes, sizes) -> None:
    out = ctx.out()
    if out.numel == 0:
        return
    summed = [ch for ch in dict.fromkeys("".join(terms)) if ch not in output]
    p = ctx.var("p", out.numel)
    values = dict(zip(output, Index(out.shape, flat=p).dims))
    loops = [(ch, ctx.var("s", sizes[ch])) for ch in summed]
    values.update(loops)
    product = None
    for i, (term, shape) in enumerate(zip(terms, shapes)):
        v = ctx.operand(i, _operand_index(term, shape, values))
        product = v if product is None else binary("mul", product, v)
    total = acc(ctx.name("sum"), out.dtype)
    body: list[ir.Stmt] = [ir.Assign(total, binary("add", total, product))]
    for position, (ch, v) in enumerate(reversed(loops)):
        inner = position == 0
        body = [ir.Loop(v, iconst(0), iconst(sizes[ch]), body, simd=inner,
                        reductions=(("+", total),) if inner else ())]
    stmts = [ir.DeclAcc(total, const(0, out.dtype)), *body,
             *ctx.results({0: (Index(out.shape, flat=p), total)})]
    work = out.numel * math.prod(sizes[ch] for ch in summed)
    ctx.stage(f"einsum ({ctx.op.id})", [ir.Loop(p, iconst(0), iconst(out.numel), stmts,
                                                parallel=1)], work)
