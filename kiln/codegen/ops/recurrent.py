"""Recurrent ops: LSTM, GRU, RNN (opaque: always alone in their block).

Per direction: the input projection X·Wᵀ + biases for every time step is one matrix product
(`kiln.codegen.ops.contraction`: the packed GEMM for float models) into scratch; then a sequential
loop over time steps runs, per step, one parallel loop over blocks of hidden units that computes
the block's recurrent sums h·Rᵀ for all gates and then updates the block's states (GRU without
`linear_before_reset` needs two: its hidden gate sums run over r ⊙ h, complete only after the
first). The hidden state is double-buffered and the cell state lives in scratch;
`sequence_lens` freezes a batch row's state past its length and zeroes its outputs there.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kiln.codegen import ir
from kiln.codegen.expr import (
    BOOL,
    Expr,
    acc,
    add,
    as_index,
    binary,
    const,
    iconst,
    imin,
    index_compare,
    load,
    local,
    make,
    modulo,
    mul,
    select,
    sub,
)
from kiln.codegen.indexing import Index
from kiln.codegen.contexts import StageCtx
from kiln.codegen.ops.registry import stage
from kiln.codegen.gemm.contraction import contraction
from kiln.codegen.gemm.spec import Contraction
from kiln.codegen.microkernel import MicroKernel, tile_for
from kiln.codegen.ops.common import c, clip01, fn, sigmoid, softplus
from kiln.ecg import Graph, Op

GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
DEFAULT_ACTIVATIONS = {"LSTM": ["Sigmoid", "Tanh", "Tanh"], "GRU": ["Sigmoid", "Tanh"],
                       "RNN": ["Tanh"]}
ACTIVATION_DEFAULTS = {"Affine": (1.0, 0.0), "LeakyRelu": (0.01, 0.0), "ThresholdedRelu": (1.0, 0.0),
                       "ScaledTanh": (1.0, 1.0), "HardSigmoid": (0.2, 0.5), "Elu": (1.0, 0.0)}
ACTIVATIONS = {"Relu", "Tanh", "Sigmoid", "Softsign", "Softplus", *ACTIVATION_DEFAULTS}
# A block of hidden units holds a whole number of cache lines of each gate's sums: two threads
# never write the same line of them, and the state update runs over whole vectors.
CACHE_LINE_BYTES = 64
# The vector accumulators of a block's sums: enough independent FMA chains to cover the FMA
# latency times the FMA ports (4 cycles × 2 on current x86-64 and aarch64 cores).
SUM_VECTORS = 8

Activation = Callable[[Expr], Expr]


def activation(name: str, alpha: float | None, beta: float | None) -> Activation:
    da, db = ACTIVATION_DEFAULTS.get(name, (0.0, 0.0))
    a = da if alpha is None else alpha
    b = db if beta is None else beta

    def apply(x: Expr) -> Expr:
        zero = c(0, x)
        if name == "Relu":
            return select(make("lt", BOOL, (x, zero)), zero, x)
        if name == "Tanh":
            return fn("tanh", x)
        if name == "Sigmoid":
            return sigmoid(x)
        if name == "Affine":
            return binary("add", binary("mul", c(a, x), x), c(b, x))
        if name == "LeakyRelu":
            return select(make("lt", BOOL, (x, zero)), binary("mul", c(a, x), x), x)
        if name == "ThresholdedRelu":
            return select(make("gt", BOOL, (x, c(a, x))), x, zero)
        if name == "ScaledTanh":
            return binary("mul", c(a, x), fn("tanh", binary("mul", c(b, x), x)))
        if name == "HardSigmoid":
            return clip01(binary("add", binary("mul", c(a, x), x), c(b, x)))
        if name == "Elu":
            negative = binary("mul", c(a, x), binary("sub", fn("exp", x), c(1, x)))
            return select(make("lt", BOOL, (x, zero)), negative, x)
        if name == "Softsign":
            return binary("div", x, binary("add", c(1, x), make("abs", x.dtype, (x,))))
        if name == "Softplus":
            return softplus(x)
        raise AssertionError(name)
    return apply


def _check(op: Op, graph: Graph) -> str | None:
    names = op.attrs.get("activations") or []
    unknown = sorted(set(names) - ACTIVATIONS)
    if unknown:
        return f"activation {', '.join(unknown)}"
    if graph.tensors[op.inputs[0]].dtype not in ("float32", "float64"):
        return "floating-point input only"
    return None


@dataclass
class Recurrence:
    kind: str
    seq: int
    batch: int
    hidden: int
    inputs: int
    directions: int
    layout: int
    dtype: str


def _activations(ctx: StageCtx, kind: str, directions: int) -> list[list[Activation]]:
    per = len(DEFAULT_ACTIVATIONS[kind])
    names = ctx.attr("activations") or DEFAULT_ACTIVATIONS[kind] * directions
    alphas, betas = ctx.attr("activation_alpha") or [], ctx.attr("activation_beta") or []
    funcs = [activation(n, alphas[i] if i < len(alphas) else None,
                        betas[i] if i < len(betas) else None) for i, n in enumerate(names)]
    return [funcs[d * per:(d + 1) * per] for d in range(directions)]


@stage("LSTM", "GRU", "RNN", check=_check)
def _recurrent(ctx: StageCtx) -> None:
    kind = ctx.op.op_type
    x_shape = ctx.tensor(0).shape
    layout = ctx.attr("layout", 0)
    seq, batch = (x_shape[1], x_shape[0]) if layout else (x_shape[0], x_shape[1])
    hidden = ctx.attr("hidden_size")
    dirs = 2 if ctx.attr("direction", "forward") == "bidirectional" else 1
    r = Recurrence(kind, seq, batch, hidden, x_shape[2], dirs, layout, ctx.out(0).dtype)
    acts = _activations(ctx, kind, dirs)
    reverse = ctx.attr("direction", "forward") == "reverse"
    for d in range(dirs):
        _direction(ctx, r, d, reverse or d == 1, acts[d])


def _direction(ctx: StageCtx, r: Recurrence, d: int, backwards: bool,
               acts: list[Activation]) -> None:
    kind, dtype, hidden = r.kind, r.dtype, r.hidden
    rows = GATES[kind] * hidden
    lbr = kind == "GRU" and ctx.attr("linear_before_reset", 0)
    x_shape, w_shape = ctx.tensor(0).shape, ctx.tensor(1).shape

    def x_at(t: Expr, b: Expr, i: Expr) -> Expr:
        dims = [b, t, i] if r.layout else [t, b, i]
        return ctx.operand(0, Index(x_shape, dims=dims))

    def bias(k: int | Expr) -> Expr:
        if not ctx.has(3):
            return const(0, dtype)
        return ctx.operand(3, Index(ctx.tensor(3).shape, dims=[iconst(d), _ix(k)]))

    # input projection for all steps, one matrix product over (step, batch) rows:
    # xw[t, b, g] = x·W[g] + Wb[g] (+ Rb[g] outside a reset gate)
    xw = ctx.scratch(dtype, r.seq * r.batch * rows)

    def finish(total: Expr, _: Expr, tb: Expr, g: Expr) -> Expr:
        recurrent_bias = bias(add(g, rows))
        if lbr:
            recurrent_bias = select(index_compare("lt", g, 2 * hidden), recurrent_bias,
                                    const(0, dtype))
        return binary("add", binary("add", total, bias(g)), recurrent_bias)

    def x_row(_: Index, tb: Expr, i: Expr) -> Expr:
        t, b = Index((r.seq, r.batch), flat=tb).dims
        return x_at(t, b, i)

    contraction(ctx, Contraction(
        (), r.seq * r.batch, rows, r.inputs, (), (), x_row,
        lambda _, i, g: ctx.operand(1, Index(w_shape, dims=[iconst(d), g, i])),
        lambda _, tb, g: Index((r.seq * r.batch, rows), dims=[tb, g]), finish, dtype,
        store=lambda _, tb, g, value: [ir.Store(xw, add(mul(tb, rows), g), value)]))
    ctx.attach_info()

    # states: the hidden state is double-buffered (a step reads all of h while the threads write
    # their units of the next h), so one step needs one barrier
    states = r.batch * hidden
    h_state = ctx.scratch(dtype, 2 * states)
    c_state = ctx.scratch(dtype, states) if kind == "LSTM" else None
    q = ctx.var("q", states)
    qb, qj = Index((r.batch, hidden), flat=q).dims
    init = [ir.Store(h_state, q, _initial(ctx, 5, d, qb, qj, dtype))]
    if c_state:
        init.append(ir.Store(c_state, q, _initial(ctx, 6, d, qb, qj, dtype)))

    step = ctx.var("step", r.seq)
    t_now = add(mul(step, -1), r.seq - 1) if backwards else step
    h_in = mul(modulo(step, 2), states)
    h_out = sub(iconst(states), h_in)
    ph = _Phases(ctx, r, d)

    def update(b: Expr, j: Expr, sums: GateSums) -> list[ir.Stmt]:
        return _update(ctx, r, d, t_now, xw, (h_state, h_in, h_out), c_state, acts, bool(lbr),
                       b, j, sums)

    if kind == "GRU" and not lbr:
        reset = ctx.scratch(dtype, states)
        step_body = [ph.phase([0, 1], h_state, h_in,
                              lambda b, j, sums: _reset_hidden(ctx, r, xw, t_now, acts,
                                                               (h_state, h_in), reset, b, j,
                                                               sums)),
                     ph.phase([2], reset, iconst(0), update)]
    else:
        step_body = [ph.phase(list(range(GATES[kind])), h_state, h_in, update)]
    time_loop = ir.Loop(step, iconst(0), iconst(r.seq), step_body)
    final = _final_states(ctx, r, d, h_state, (r.seq % 2) * states, c_state)
    ctx.stage(f"{kind} ({ctx.op.id}) direction {d}: recurrence",
              [ir.Loop(q, iconst(0), iconst(states), init), time_loop, *final],
              r.batch * rows * hidden)


def _ix(k: int | Expr) -> Expr:
    return iconst(k) if isinstance(k, int) else k


def _initial(ctx: StageCtx, position: int, d: int, b: Expr, j: Expr, dtype: str) -> Expr:
    if not ctx.has(position):
        return const(0, dtype)
    shape = ctx.tensor(position).shape
    dims = [b, iconst(d), j] if ctx.attr("layout", 0) else [iconst(d), b, j]
    return ctx.operand(position, Index(shape, dims=dims))


GateSums = Callable[[int], Expr]  # gate → its recurrent sum at the tail's (batch row, unit)
Tail = Callable[[Expr, Expr, GateSums], list[ir.Stmt]]  # (b, j, sums) → statements


@dataclass
class _Phases:
    """A step's parallel loops. Each runs over blocks of hidden units (and batch rows): first the
    recurrent sums of the block's rows of some gates — all gates of a unit share each load of the
    state — then a per-unit tail over the block while its sums are still in L1. The blocks are
    shared out evenly, the same way every step, so a thread reads the same rows of R each step
    (they stay in its caches as far as they fit) and the tail needs no other thread's sums.

    The sums live in scratch blocked as [b, block, gate, unit of the block]. With a constant R and
    a CPU's vector micro-kernels, a phase's rows of R are packed at compile time in the order the
    sums read them, [block, k, gate, unit], and one 1-row micro-kernel call per block computes
    all of the block's sums in registers from one contiguous stream of R."""

    ctx: StageCtx
    r: Recurrence
    d: int

    def __post_init__(self) -> None:
        self.unit = self._unit(np.dtype(self.r.dtype).itemsize)
        self.blocks = -(-self.r.hidden // self.unit)
        self.gates = self.ctx.scratch(self.r.dtype, self.r.batch * self.blocks * GATES[self.r.kind]
                                      * self.unit)

    def _unit(self, itemsize: int) -> int:
        """Units per block: the block's sums over the widest phase's gates fill SUM_VECTORS
        vectors of the target (at least a cache line per gate)."""
        kind = self.r.kind
        gates = 2 if kind == "GRU" and not self.ctx.attr("linear_before_reset", 0) else GATES[kind]
        line_units = max(1, CACHE_LINE_BYTES // itemsize)
        vector = max(self.ctx.schedule.vector_bytes, 1)
        lines = max(1, -(-SUM_VECTORS * vector // (CACHE_LINE_BYTES * gates)))
        return line_units * lines

    def _sum_at(self, b: Expr, block: Expr, gate: int, u: Expr | int) -> Expr:
        return add(mul(add(mul(add(mul(b, self.blocks), block), GATES[self.r.kind]), gate),
                       self.unit), u)

    def phase(self, gate_ids: list[int], source: str, source_offset: Expr, tail: Tail) -> ir.Loop:
        ctx, r, unit = self.ctx, self.r, self.unit
        p = ctx.var("p", self.blocks * r.batch)
        block, b = Index((self.blocks, r.batch), flat=p).dims
        first = mul(block, unit)
        units = sub(imin(add(first, unit), r.hidden), first)
        row = add(source_offset, mul(b, r.hidden))
        packed = self._packed(gate_ids)
        sums = (self._panel_sums(packed, gate_ids, source, row, b, block) if packed
                else self._dot_sums(gate_ids, source, row, b, block, units))
        u = ctx.var("u", unit)

        def sum_of(gate: int) -> Expr:
            return load(self.gates, r.dtype, self._sum_at(b, block, gate, u))

        work = r.batch * len(gate_ids) * r.hidden * r.hidden
        return ir.Loop(p, iconst(0), iconst(self.blocks * r.batch),
                       [*sums, ir.Loop(u, iconst(0), units, tail(b, add(first, u), sum_of),
                                       simd=True)],
                       parallel=1 if work >= ctx.schedule.parallel_min_work else 0)

    def _packed(self, gate_ids: list[int]) -> tuple[str, MicroKernel] | None:
        """R's rows of `gate_ids` as a derived constant [block, k, gate, unit] (units past the
        hidden size zero) and the 1-row micro-kernel over one block; None where R is not a
        constant or the target has no vector micro-kernels."""
        ctx, r, unit = self.ctx, self.r, self.unit
        s = ctx.schedule
        weights = ctx.const(2)
        if weights is None or s.vector_bytes <= 0 or s.gemm_work_group > 0:
            return None
        uk = tile_for((), r.dtype, s.vector_bytes, 1, len(gate_ids) * unit)
        if uk.nr != len(gate_ids) * unit:
            return None
        padded = np.zeros((len(gate_ids), self.blocks * unit, r.hidden), weights.dtype)
        for i, g in enumerate(gate_ids):
            padded[i, :r.hidden] = weights[self.d, g * r.hidden:(g + 1) * r.hidden]
        panels = padded.reshape(len(gate_ids), self.blocks, unit, r.hidden).transpose(1, 3, 0, 2)
        ctx.info["recurrent_weights"] = "pre-packed constant"
        return ctx.derived(np.ascontiguousarray(panels)), uk

    def _panel_sums(self, packed: tuple[str, MicroKernel], gate_ids: list[int], source: str,
                    row: Expr, b: Expr, block: Expr) -> list[ir.Stmt]:
        panels, uk = packed
        hidden = self.r.hidden
        return [ir.MicroKernelCall(uk, iconst(hidden), source, row, panels,
                                   mul(block, hidden * uk.nr), uk.nr, self.gates,
                                   self._sum_at(b, block, gate_ids[0], 0), uk.nr, iconst(0))]

    def _dot_sums(self, gate_ids: list[int], source: str, row: Expr, b: Expr, block: Expr,
                  units: Expr) -> list[ir.Stmt]:
        """sums[b, block, g, u] = Σ_k source[row + k] · R[d, g·H + block·U + u, k] for each g in
        gate_ids, a dot product per unit."""
        ctx, r = self.ctx, self.r
        hidden, dtype = r.hidden, r.dtype
        u = ctx.var("u", self.unit)
        j = add(mul(block, self.unit), u)
        totals = [acc(ctx.name("sum"), dtype) for _ in gate_ids]
        k = ctx.var("k", hidden)
        state = load(source, dtype, add(row, k))
        r_shape = ctx.tensor(2).shape
        body: list[ir.Stmt] = [
            ir.Assign(total, binary("add", total, binary("mul", state, ctx.operand(
                2, Index(r_shape, dims=[iconst(self.d), add(j, g * hidden), k])))))
            for g, total in zip(gate_ids, totals)]
        loop = ir.Loop(k, iconst(0), iconst(hidden), body, simd=True,
                       reductions=tuple(("+", total) for total in totals))
        return [ir.Loop(u, iconst(0), units, [
            *(ir.DeclAcc(total, const(0, dtype)) for total in totals), loop,
            *(ir.Store(self.gates, self._sum_at(b, block, g, u), total)
              for g, total in zip(gate_ids, totals))])]


def _reset_hidden(ctx: StageCtx, r: Recurrence, xw: str, t: Expr, acts: list[Activation],
                  h: tuple[str, Expr], reset: str, b: Expr, j: Expr,
                  sums: GateSums) -> list[ir.Stmt]:
    """GRU without linear_before_reset: reset[b, j] = r_t[b, j] · h[b, j], the vector the hidden
    gate's recurrent sum runs over."""
    h_state, h_in = h
    q = add(mul(b, r.hidden), j)
    pre = _preactivation(ctx, r, xw, t, b, j, 1, sums)
    return [ir.Store(reset, q, binary("mul", acts[0](pre),
                                      load(h_state, r.dtype, add(h_in, q))))]


def _xw_at(r: Recurrence, xw: str, t: Expr, b: Expr, g: Expr) -> Expr:
    rows = GATES[r.kind] * r.hidden
    return load(xw, r.dtype, add(mul(add(mul(t, r.batch), b), rows), g))


def _preactivation(ctx: StageCtx, r: Recurrence, xw: str, t: Expr, b: Expr, j: Expr, gate: int,
                   sums: GateSums, peephole: Expr | None = None) -> Expr:
    """A gate's activation input: x·W + biases + h·R (+ an LSTM peephole term), clipped (the
    `clip` attribute bounds the input of the activations, peephole included)."""
    value = binary("add", _xw_at(r, xw, t, b, add(j, gate * r.hidden)), sums(gate))
    if peephole is not None:
        value = binary("add", value, peephole)
    return _clipped(ctx, value)


def _update(ctx: StageCtx, r: Recurrence, d: int, t: Expr, xw: str, h: tuple[str, Expr, Expr],
            c_state: str | None, acts: list[Activation], lbr: bool, b: Expr, j: Expr,
            sums: GateSums) -> list[ir.Stmt]:
    """The state update of unit j of batch row b: reads h at h_in, writes it at h_out."""
    dtype, hidden = r.dtype, r.hidden
    h_state, h_in, h_out = h
    q = add(mul(b, hidden), j)
    h_prev = local(ctx.name("h"), dtype)
    valid = _valid(ctx, b, t)
    reads_previous = r.kind == "GRU" or valid is not None
    stmts: list[ir.Stmt] = ([ir.Let(h_prev, load(h_state, dtype, add(h_in, q)))]
                            if reads_previous else [])

    def pre(gate: int, peephole: Expr | None = None) -> Expr:
        return _preactivation(ctx, r, xw, t, b, j, gate, sums, peephole)

    c_new = c_prev = None
    if r.kind == "LSTM":
        c_prev = local(ctx.name("c"), dtype)
        stmts.append(ir.Let(c_prev, load(c_state, dtype, q)))
        peephole = _peepholes(ctx, d, j)
        f_act, g_act, h_act = acts
        i_gate = f_act(pre(0, peephole(0, c_prev)))
        if ctx.attr("input_forget", 0):
            f_gate = binary("sub", c(1, i_gate), i_gate)
        else:
            f_gate = f_act(pre(2, peephole(2, c_prev)))
        candidate = g_act(pre(3))
        c_value = binary("add", binary("mul", f_gate, c_prev), binary("mul", i_gate, candidate))
        c_new = local(ctx.name("c"), dtype)
        stmts.append(ir.Let(c_new, c_value))
        o_gate = f_act(pre(1, peephole(1, c_new)))
        h_value = binary("mul", o_gate, h_act(c_new))
    elif r.kind == "GRU":
        f_act, g_act = acts
        z = f_act(pre(0))
        if lbr:
            reset = f_act(pre(1))
            g_row = add(j, 2 * hidden)
            recurrent = binary("add", sums(2), _recurrent_bias(ctx, d, g_row, 3 * hidden, dtype))
            xw_h = _xw_at(r, xw, t, b, g_row)
            candidate = g_act(_clipped(ctx, binary("add", xw_h, binary("mul", reset, recurrent))))
        else:
            candidate = g_act(pre(2))
        h_value = binary("add", binary("mul", binary("sub", c(1, z), z), candidate),
                         binary("mul", z, h_prev))
    else:
        h_value = acts[0](pre(0))
    h_new = local(ctx.name("h"), dtype)
    stmts.append(ir.Let(h_new, h_value))
    keep_h = h_new if valid is None else select(valid, h_new, h_prev)
    stmts.append(ir.Store(h_state, add(h_out, q), keep_h))
    if c_state is not None:
        keep_c = c_new if valid is None else select(valid, c_new, c_prev)
        stmts.append(ir.Store(c_state, q, keep_c))
    y = h_new if valid is None else select(valid, h_new, const(0, dtype))
    if ctx.output_used(0):
        y_shape = ctx.out(0).shape
        dims = [b, t, iconst(d), j] if r.layout else [t, iconst(d), b, j]
        stmts += ctx.results({0: (Index(y_shape, dims=dims), y)})
    return stmts


def _clipped(ctx: StageCtx, value: Expr) -> Expr:
    limit = ctx.attr("clip")
    if limit is None:
        return value
    lo, hi = c(-limit, value), c(limit, value)
    value = select(make("lt", BOOL, (value, lo)), lo, value)
    return select(make("gt", BOOL, (value, hi)), hi, value)


def _recurrent_bias(ctx: StageCtx, d: int, g: Expr, rows: int, dtype: str) -> Expr:
    if not ctx.has(3):
        return const(0, dtype)
    return ctx.operand(3, Index(ctx.tensor(3).shape, dims=[iconst(d), add(g, rows)]))


def _peepholes(ctx: StageCtx, d: int, j: Expr) -> Callable[[int, Expr], Expr | None]:
    """gate (0 input, 1 output, 2 forget), cell state → the gate's peephole term, None without
    peepholes."""
    if not ctx.has(7):
        return lambda gate, cell: None
    shape = ctx.tensor(7).shape
    hidden = shape[1] // 3
    return lambda gate, cell: binary("mul", ctx.operand(
        7, Index(shape, dims=[iconst(d), add(j, gate * hidden)])), cell)


def _valid(ctx: StageCtx, b: Expr, t: Expr) -> Expr | None:
    if not ctx.has(4):
        return None
    length = as_index(ctx.operand(4, Index(ctx.tensor(4).shape, dims=[b])))
    return make("lt", BOOL, (t, length))


def _final_states(ctx: StageCtx, r: Recurrence, d: int, h_state: str, h_at: int,
                  c_state: str | None) -> list[ir.Stmt]:
    q = ctx.var("q", r.batch * r.hidden)
    b, j = Index((r.batch, r.hidden), flat=q).dims
    results: dict[int, tuple[Index, Expr]] = {}
    for position, state, at in ((1, h_state, h_at), (2, c_state, 0)):
        if state is not None and ctx.output_used(position):
            shape = ctx.out(position).shape
            dims = [b, iconst(d), j] if r.layout else [iconst(d), b, j]
            results[position] = (Index(shape, dims=dims), load(state, r.dtype, add(q, at)))
    if not results:
        return []
    return [ir.Loop(q, iconst(0), iconst(r.batch * r.hidden), ctx.results(results))]

