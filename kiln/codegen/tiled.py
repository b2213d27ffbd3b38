"""GraphTurbo's kernel generation (§4): a stage of several layers run instance by instance, by
loop fusion and buffer stitching.

The partitioner (`kiln.plan.graphturbo`) cuts a stage's rows into instances and says which
window of rows of each kept tensor an instance computes (`kiln.plan.scopes`: the instance's own
rows plus the halo rows a convolution further on reads). The kernel is one parallel loop over
(image, instance); each iteration runs every layer of the stage for its rows, in op order:

* a convolution computes its window of output rows: a 1×1 convolution as a GEMM over the
  window's pixels with the backend's register-blocked micro-kernel (weights packed at compile
  time, the window's rows read in place as the B operand), any other (depthwise 3×3, strided) as
  direct loops whose taps narrow to the valid input rows and columns;
* an elementwise chain (bias, Clip, SiLU, residual Add, ...) is evaluated inside the expression
  that stores the next kept tensor or output (register scope, DNNFusion's data-flow-tree walk);
* intermediates live in window buffers of the instance — one stack arena per iteration, laid out
  by the plan's allocation (L1 region, L2 region, spilled region; buffers whose liveness does
  not overlap share bytes) — never in full tensors: buffer stitching. Only the stage's outputs
  are written to memory, each instance its own rows.

A MobileNetV2 inverted residual (1×1 expand → 3×3 depthwise → 1×1 project, + the block input)
thus runs over row tiles whose expanded intermediate stays in the core's L2.
"""
from __future__ import annotations

import math

import numpy as np

from kiln.codegen import ir
from kiln.codegen.contexts import NeedsBuffer, NotFusable, Provided
from kiln.codegen.expr import (
    Expr,
    add,
    array_load,
    binary,
    const,
    floordiv,
    iconst,
    imax,
    index_compare,
    local,
    logical_and,
    imin,
    load,
    modulo,
    mul,
    select,
    sub,
    var,
)
from kiln.codegen.indexing import Index
from kiln.codegen.lower import Builder, BlockLowering, LoweredBlock, Names
from kiln.codegen.microkernel import tile_for
from kiln.codegen.ops.conv_window import valid_taps, window
from kiln.codegen.schedule import Schedule
from kiln.ecg import Graph, Op, Tensor
from kiln.plan import Block
from kiln.plan.scopes import SCOPES, Window, epilogue_target, is_row_conv, kept_tensors

MAX_ARENA_BYTES = 4 << 20  # an instance's buffers live on its thread's stack
ARENA = "tile"
TAIL = "tailpanel"
COLS = "patches"  # a k×k convolution's unrolled input patches
MAX_PATCH_BYTES = 2 << 20
MAX_BORDER_COLUMNS = 16  # the zero-padded last pixels of a 1×1 convolution's window
ALIGN = 64


class NotTileable(Exception):
    """The stage has a form this generator does not produce: the block lowers as usual."""


class _WindowBuilder(Builder):
    """Element expressions inside one instance: kept tensors are read from their windows."""

    def __init__(self, low: TiledLowering, computing: str | None = None,
                 provided: dict[str, Provided] | None = None):
        super().__init__(low, provided)
        self.tiled = low
        self.computing = computing  # the kept tensor being computed: from its producer

    def _value(self, t: Tensor, index: Index) -> Expr:
        if t.id in self.tiled.buffers and t.id != self.computing:
            return array_load(ARENA, t.dtype, self.tiled.window_offset(t.id, index.dims))
        return super()._value(t, index)


class TiledLowering(BlockLowering):
    def __init__(self, graph: Graph, block: Block, symbol: str, schedule: Schedule, stage):
        super().__init__(graph, block, symbol, schedule)
        self.stage = stage
        self.windows: dict[str, Window] = {w.tensor: w for w in stage.windows}

    def lower(self) -> LoweredBlock:
        graph, block = self.graph, self.block
        self.names = Names()
        self.ready = {t for t in block.inputs if not graph.tensors[t].is_constant}
        self.stages, self.stage_info, self.scratch_buffers = [], [], []
        self.scratch_top, self.derived, self.assigned = 0, {}, set()
        kept = kept_tensors(graph, block.op_ids, block.outputs)
        self.buffers = self._layout(kept)
        out = graph.tensors[graph.op_by_id[block.op_ids[-1]].outputs[0]]
        batch, parts = out.shape[0], self.stage.split.parts
        p = var(self.names("p"), batch * parts)
        self.image, self.part = floordiv(p, parts), modulo(p, parts)
        self.tail_floats = self.cols_floats = 0
        body: list[ir.Stmt] = [ir.DeclArray(ARENA, "float32", self.arena_floats)]
        computed: set[str] = set()
        for op in self.ops:
            if is_row_conv(graph, op):
                body += self._conv_layer(op, computed)
            for t in op.outputs:
                if t in self.buffers and t not in computed:
                    body += self._elementwise(t, self.window_rows(t), into_window=True)
                    computed.add(t)
                if t in block.outputs and (t in self.buffers or t not in computed):
                    body += self._elementwise(t, self.own_rows(t),
                                              into_window=False)
        if self.tail_floats:
            body.insert(1, ir.DeclArray(TAIL, "float32", self.tail_floats))
        if self.cols_floats:
            body.insert(1, ir.DeclArray(COLS, "float32", self.cols_floats))
        loop = ir.Loop(p, iconst(0), iconst(batch * parts), body, parallel=1, grain="one")
        work = sum(graph.tensors[t].numel for t in block.outputs) * len(self.ops)
        self.add_stage(f"tiled stage: {len(self.ops)} ops over {parts} row instances", [loop],
                       work)
        self.stage_info[-1].update(form="tiled", instances=batch * parts,
                                   arena_bytes=self.arena_floats * 4)
        return self._result()

    # --- window buffers --------------------------------------------------------------------
    def _layout(self, kept: list[str]) -> dict[str, int]:
        """Float offset of each kept tensor's window in the arena: the plan's offsets within
        each scope's region, regions one after another (L1, L2, spilled)."""
        region_end: dict[str, int] = {}
        for b in self.stage.buffers:
            region_end[b.scope] = max(region_end.get(b.scope, 0), b.offset + b.nbytes)
        base, start = 0, {}
        for scope in SCOPES:
            start[scope] = base
            base += -(-region_end.get(scope, 0) // ALIGN) * ALIGN
        if base > MAX_ARENA_BYTES:
            raise NotTileable(f"instance buffers of {base} bytes")
        offsets = {}
        for t in kept:
            placed = self.stage.placed(t)
            if placed is None or t not in self.windows:
                raise NotTileable(f"{t} has no window")
            offsets[t] = (start[placed.scope] + placed.offset) // 4
        self.arena_floats = base // 4 + 64  # a micro-kernel may read one panel past a window
        return offsets

    def window_start(self, tensor: str) -> Expr:
        w = self.windows[tensor]
        return imin(imax(add(mul(self.part, w.step), w.lo), 0), w.height - w.rows)

    def window_rows(self, tensor: str) -> tuple[Expr, int]:
        return self.window_start(tensor), self.windows[tensor].rows

    def own_rows(self, tensor: str) -> tuple[Expr, int]:
        step = self.graph.tensors[tensor].shape[2] // self.stage.split.parts
        return mul(self.part, step), step

    def window_offset(self, tensor: str, dims) -> Expr:
        _, c, y, x = dims
        shape = self.graph.tensors[tensor].shape
        rows = self.windows[tensor].rows
        return add(self.buffers[tensor], mul(add(mul(c, rows), sub(y, self.window_start(tensor))),
                                             shape[3]), x)

    def builder(self, provided=None) -> Builder:
        return _WindowBuilder(self)

    # --- one layer ---------------------------------------------------------------------------
    def _conv_layer(self, op: Op, computed: set[str]) -> list[ir.Stmt]:
        """The convolution over the rows its destination needs: its result's window, or the
        window (or own rows) of the tensor its elementwise epilogue ends at."""
        t = op.outputs[0]
        dest = t
        if t not in self.buffers and t not in self.block.outputs:
            dest = epilogue_target(self.graph, self.block.op_ids, self.block.outputs, t)
            if dest is None:
                raise NotTileable(f"{t} is read but neither kept nor fused")
        computed.add(dest)
        if dest in self.buffers:
            return self._conv(op, dest, self.window_rows(dest), into_window=True)
        return self._conv(op, dest, self.own_rows(dest), into_window=False)

    def _conv_result(self, op: Op, dest: str, into_window: bool, m: Expr, y: Expr, x: Expr,
                     value: Expr) -> list[ir.Stmt]:
        """Store the convolution's result at (m, y, x), or the epilogue tensor computed from it."""
        t = op.outputs[0]
        if dest == t:
            return [self._dest(t, into_window, m, y, x, value)]
        held = local(self.names("x"), value.dtype)
        shape = self.graph.tensors[t].shape
        provided = {t: Provided(Index(shape, dims=[self.image, m, y, x]).flat, held)}
        index = Index(self.graph.tensors[dest].shape, dims=[self.image, m, y, x])
        try:
            result = _WindowBuilder(self, dest, provided).value(dest, index)
        except (NotFusable, NeedsBuffer) as refused:
            raise NotTileable(f"epilogue {dest}: {refused}") from None
        return [ir.Let(held, value), self._dest(dest, into_window, m, y, x, result)]

    def _dest(self, tensor: str, into_window: bool, m: Expr, y: Expr, x: Expr,
              value: Expr) -> ir.Stmt:
        if into_window:
            return ir.ArrayStore(ARENA, self.window_offset(tensor, (None, m, y, x)), value)
        shape = self.graph.tensors[tensor].shape
        index = Index(shape, dims=[self.image, m, y, x])
        return ir.Store(tensor, index.flat, value)

    def _elementwise(self, tensor: str, rows: tuple[Expr, int], into_window: bool
                     ) -> list[ir.Stmt]:
        _, channels, _, width = self.graph.tensors[tensor].shape
        a, n = rows
        c, r, x = (var(self.names(k), e) for k, e in (("c", channels), ("y", n), ("x", width)))
        y = add(a, r)
        index = Index(self.graph.tensors[tensor].shape, dims=[self.image, c, y, x])
        try:
            value = _WindowBuilder(self, tensor if into_window else None).value(tensor, index)
        except (NotFusable, NeedsBuffer) as refused:
            raise NotTileable(f"{tensor}: {refused}") from None
        store = self._dest(tensor, into_window, c, y, x, value)
        return [ir.Loop(c, iconst(0), iconst(channels),
                        [ir.Loop(r, iconst(0), iconst(n),
                                 [ir.Loop(x, iconst(0), iconst(width), [store], simd=True)])])]

    # --- convolutions ------------------------------------------------------------------------
    def _read_x(self, op: Op, c: Expr, y: Expr, x: Expr) -> Expr:
        t = self.graph.tensors[op.inputs[0]]
        if t.id in self.buffers:
            return array_load(ARENA, t.dtype, self.window_offset(t.id, (None, c, y, x)))
        if t.id not in self.ready:
            raise NotTileable(f"convolution input {t.id} is neither kept nor an input")
        return load(t.id, t.dtype, Index(t.shape, dims=[self.image, c, y, x]).flat)

    def _bias(self, op: Op, m: Expr) -> Expr | None:
        if len(op.inputs) < 3 or op.inputs[2] is None:
            return None
        b = self.graph.tensors[op.inputs[2]]
        return self.constant_value(b, Index(b.shape, dims=[m]))

    def _conv(self, op: Op, dest: str, rows: tuple[Expr, int], into_window: bool
              ) -> list[ir.Stmt]:
        x_shape = self.graph.tensors[op.inputs[0]].shape
        w_t = self.graph.tensors[op.inputs[1]]
        out = self.graph.tensors[op.outputs[0]]
        geometry = window(op, x_shape[2:], out.shape[2:], tuple(w_t.shape[2:]))
        group = op.attrs.get("group", 1)
        pointwise = (geometry.kernel == (1, 1) and geometry.strides == (1, 1) and group == 1
                     and not any(geometry.pad_begin) and not any(geometry.pad_end))
        if pointwise and out.shape[3] == x_shape[3]:
            return self._pointwise(op, dest, rows, into_window)
        uk = self._micro_kernel()
        columns = -(-rows[1] * out.shape[3] // uk.nr) * uk.nr
        patches = x_shape[1] * math.prod(geometry.kernel) * columns
        if (group == 1 and len(geometry.kernel) == 2 and patches * 4 <= MAX_PATCH_BYTES
                and out.shape[1] >= self.schedule.conv_gemm_min_cout):
            return self._im2col(op, dest, geometry, rows, into_window)
        return self._direct(op, dest, geometry, group, rows, into_window)

    def _micro_kernel(self):
        return tile_for((), "float32", self.schedule.vector_bytes, self.schedule.gemm_mr,
                        self.schedule.gemm_nr)

    def _packed_weights(self, op: Op, mr: int) -> tuple[str, int, int]:
        """The weights as micro-kernel panels of `mr` output channels (a derived constant):
        (name, panels, length of the sum)."""
        w = self.graph.tensors[op.inputs[1]].data
        m_total = w.shape[0]
        matrix = w.reshape(m_total, -1)
        panels = -(-m_total // mr)
        packed = np.zeros((panels * mr, matrix.shape[1]), dtype=np.float32)
        packed[:m_total] = matrix
        packed = packed.reshape(panels, mr, matrix.shape[1]).transpose(0, 2, 1)
        return self.derived_constant(np.ascontiguousarray(packed)), panels, matrix.shape[1]

    def _gemm(self, op: Op, dest: str, rows: tuple[Expr, int], into_window: bool, b_name: str,
              b_base: Expr, ldb: int, columns: int, valid: int) -> list[ir.Stmt]:
        """out[m, j] = W[m, :] · B[:, j] + bias for `columns` (a multiple of the micro-kernel's
        width) columns of B from `b_base` (`ldb` apart per row of the sum), of which the first
        `valid` are output pixels of the rows (row-major over the output width)."""
        uk = self._micro_kernel()
        a_name, panels, depth = self._packed_weights(op, uk.mr)
        m_total, width = (self.graph.tensors[op.outputs[0]].shape[i] for i in (1, 3))
        a, _ = rows
        ct = self.names("ct")
        mp, jp = var(self.names("mp"), panels), var(self.names("jp"), max(columns // uk.nr, 1))
        m0, j0 = mul(mp, uk.mr), mul(jp, uk.nr)
        r, col = var(self.names("r"), uk.mr), var(self.names("j"), uk.nr)
        m = add(m0, r)
        j = add(j0, col)
        value = array_load(ct, "float32", add(mul(r, uk.nr), col))
        bias = self._bias(op, m)
        if bias is not None:
            value = binary("add", value, bias)
        y, x = add(a, floordiv(j, width)), sub(j, mul(floordiv(j, width), width))
        col_stop = iconst(uk.nr) if valid == columns else imin(iconst(uk.nr),
                                                                sub(iconst(valid), j0))
        epilogue = ir.Loop(r, iconst(0), imin(iconst(uk.mr), sub(iconst(m_total), m0)),
                           [ir.Loop(col, iconst(0), col_stop,
                                    self._conv_result(op, dest, into_window, m, y, x, value),
                                    simd=True)])
        call = ir.MicroKernelCall(uk, iconst(depth), a_name, mul(mp, depth * uk.mr), b_name,
                                  add(b_base, j0), ldb, ct, iconst(0), uk.nr, iconst(0))
        return [ir.Loop(mp, iconst(0), iconst(panels), [
            ir.DeclArray(ct, "float32", uk.mr * uk.nr),
            ir.Loop(jp, iconst(0), iconst(columns // uk.nr), [call, epilogue])])]

    def _pointwise(self, op: Op, dest: str, rows: tuple[Expr, int], into_window: bool
                   ) -> list[ir.Stmt]:
        """A 1×1 convolution: B is the rows' pixels, contiguous in X's window (or tensor); the
        pixels after the last whole micro-kernel panel go through a zero-padded one."""
        x_t = self.graph.tensors[op.inputs[0]]
        channels, width = x_t.shape[1], x_t.shape[3]
        a, n = rows
        pixels = n * width
        uk = self._micro_kernel()
        if x_t.id in self.buffers:
            b_name, ldb = ARENA, self.windows[x_t.id].rows * width
            b_base = add(self.buffers[x_t.id], mul(sub(a, self.window_start(x_t.id)), width))
        elif x_t.id in self.ready:
            b_name, ldb = x_t.id, x_t.shape[2] * width
            b_base = add(mul(self.image, channels * ldb), mul(a, width))
        else:
            raise NotTileable(f"convolution input {x_t.id} is neither kept nor an input")
        whole = pixels // uk.nr * uk.nr
        body = self._gemm(op, dest, rows, into_window, b_name, b_base, ldb, whole, whole) \
            if whole else []
        if pixels > whole:
            a_name, panels, _ = self._packed_weights(op, uk.mr)
            body += self._tail_panel(op, dest, rows, into_window, uk, panels, a_name, b_name, ldb,
                                     add(b_base, whole), whole, pixels - whole)
        return body

    def _im2col(self, op: Op, dest: str, w, rows: tuple[Expr, int], into_window: bool
                ) -> list[ir.Stmt]:
        """A k×k convolution of one group as a GEMM: the window's input patches unrolled into
        a buffer of (channel, tap) rows × output pixels (zero where a tap falls in the padding),
        padded to whole micro-kernel panels."""
        x_t, out = self.graph.tensors[op.inputs[0]], self.graph.tensors[op.outputs[0]]
        channels, (kh, kw), width = x_t.shape[1], w.kernel, out.shape[3]
        a, n = rows
        uk = self._micro_kernel()
        pixels = n * width
        columns = -(-pixels // uk.nr) * uk.nr
        depth = channels * kh * kw
        self.cols_floats = max(self.cols_floats, depth * columns)
        k, r, x = var(self.names("k"), depth), var(self.names("y"), n), var(self.names("x"), width)
        c, ky, kx = Index((channels, kh, kw), flat=k).dims
        iy = add(mul(add(a, r), w.strides[0]), mul(ky, w.dilations[0]), -w.pad_begin[0])
        ix = add(mul(x, w.strides[1]), mul(kx, w.dilations[1]), -w.pad_begin[1])
        inside = logical_and(logical_and(index_compare("ge", iy, 0),
                                         index_compare("lt", iy, w.in_size[0])),
                             logical_and(index_compare("ge", ix, 0),
                                         index_compare("lt", ix, w.in_size[1])))
        if x_t.id in self.buffers:
            first = self.window_start(x_t.id)
            iy_in = imin(imax(iy, first), add(first, self.windows[x_t.id].rows - 1))
        else:
            iy_in = imin(imax(iy, 0), w.in_size[0] - 1)
        ix_in = imin(imax(ix, 0), w.in_size[1] - 1)
        value = select(inside, self._read_x(op, c, iy_in, ix_in), const(0, "float32"))
        fill = ir.Loop(k, iconst(0), iconst(depth), [ir.Loop(r, iconst(0), iconst(n), [
            ir.Loop(x, iconst(0), iconst(width),
                    [ir.ArrayStore(COLS, add(mul(k, columns), mul(r, width), x), value)],
                    simd=True)])])
        body: list[ir.Stmt] = [fill]
        if columns > pixels:
            k2, q = var(self.names("k"), depth), var(self.names("q"), columns - pixels, pixels)
            body.append(ir.Loop(k2, iconst(0), iconst(depth), [
                ir.Loop(q, iconst(pixels), iconst(columns),
                        [ir.ArrayStore(COLS, add(mul(k2, columns), q), const(0, "float32"))])]))
        return body + self._gemm(op, dest, rows, into_window, COLS, iconst(0), columns, columns,
                                 pixels)

    def _tail_panel(self, op: Op, dest: str, rows, into_window: bool, uk, panels: int,
                    a_name: str, b_name: str, ldb: int, b_start: Expr, first: int, count: int
                    ) -> list[ir.Stmt]:
        """The last `count` pixels, fewer than a micro-kernel panel: copied into a zero-padded
        panel, multiplied by every weight panel, their results stored."""
        channels, width = self.graph.tensors[op.inputs[0]].shape[1], \
            self.graph.tensors[op.inputs[0]].shape[3]
        m_total = self.graph.tensors[op.outputs[0]].shape[1]
        a, _ = rows
        bt, ct = TAIL, self.names("ct")
        k, q = var(self.names("k"), channels), var(self.names("q"), uk.nr)
        source = array_load(b_name, "float32", add(b_start, mul(k, ldb), q)) \
            if b_name == ARENA else load(b_name, "float32", add(b_start, mul(k, ldb), q))
        fill = ir.Loop(k, iconst(0), iconst(channels), [
            ir.Loop(q, iconst(0), iconst(count), [ir.ArrayStore(bt, add(mul(k, uk.nr), q), source)],
                    simd=True)])
        q2 = var(self.names("q"), uk.nr - count, count)
        pad = ir.Loop(k, iconst(0), iconst(channels), [
            ir.Loop(q2, iconst(count), iconst(uk.nr),
                    [ir.ArrayStore(bt, add(mul(k, uk.nr), q2), const(0, "float32"))])])
        mp, r, col = (var(self.names(n), e) for n, e in (("mp", panels), ("r", uk.mr),
                                                          ("j", count)))
        m = add(mul(mp, uk.mr), r)
        j = add(col, first)
        y, x = add(a, floordiv(j, width)), sub(j, mul(floordiv(j, width), width))
        value = array_load(ct, "float32", add(mul(r, uk.nr), col))
        bias = self._bias(op, m)
        if bias is not None:
            value = binary("add", value, bias)
        call = ir.MicroKernelCall(uk, iconst(channels), a_name, mul(mp, channels * uk.mr), bt,
                                  iconst(0), uk.nr, ct, iconst(0), uk.nr, iconst(0))
        epilogue = ir.Loop(r, iconst(0), imin(iconst(uk.mr), sub(iconst(m_total), mul(mp, uk.mr))),
                           [ir.Loop(col, iconst(0), iconst(count),
                                    self._conv_result(op, dest, into_window, m, y, x, value),
                                    simd=True)])
        panel_loop = ir.Loop(mp, iconst(0), iconst(panels),
                             [ir.DeclArray(ct, "float32", uk.mr * uk.nr), call, epilogue])
        self.tail_floats = max(self.tail_floats, channels * uk.nr)
        return [fill, pad, panel_loop]

    def _direct(self, op: Op, dest: str, w, group: int, rows: tuple[Expr, int],
                into_window: bool) -> list[ir.Stmt]:
        """Per output channel and row: a row of accumulators, summed over the input channels of
        the group and the valid taps, the inner loop vectorised over output columns."""
        if len(w.kernel) != 2:
            raise NotTileable("not a 2-D convolution")
        w_t, out = self.graph.tensors[op.inputs[1]], self.graph.tensors[op.outputs[0]]
        channels = self.graph.tensors[op.inputs[0]].shape[1]
        m_total, width = out.shape[1], out.shape[3]
        cg, mg = channels // group, m_total // group
        a, n = rows
        m, r = var(self.names("m"), m_total), var(self.names("y"), n)
        y = add(a, r)
        row = self.names("row")
        ci, ky = var(self.names("c"), cg), var(self.names("ky"), w.kernel[0])
        iy = add(mul(y, w.strides[0]), mul(ky, w.dilations[0]), -w.pad_begin[0])
        c = add(mul(floordiv(m, mg), cg), ci)

        def taps_sum(col: Expr, kxs: list[int]) -> Expr:
            """The row's sum over the taps `kxs` of kernel row ky at output column `col`."""
            total = array_load(row, "float32", col)
            for k in kxs:
                ix = add(mul(col, w.strides[1]), k * w.dilations[1] - w.pad_begin[1])
                weight = self.constant_value(w_t, Index(w_t.shape, dims=[m, ci, ky, iconst(k)]))
                total = binary("add", total, binary("mul", weight, self._read_x(op, c, iy, ix)))
            return total

        def valid(x: int) -> list[int]:
            return [k for k in range(w.kernel[1])
                    if 0 <= x * w.strides[1] + k * w.dilations[1] - w.pad_begin[1] < w.in_size[1]]

        # columns whose every tap lies inside the row: one vectorised loop, taps unrolled in
        # registers; the few border columns one by one with their own taps
        inner_lo = min(width, -(-w.pad_begin[1] // w.strides[1]))
        inner_hi = max(inner_lo, min(width, (w.in_size[1] - 1 - (w.kernel[1] - 1) * w.dilations[1]
                                              + w.pad_begin[1]) // w.strides[1] + 1))
        if inner_lo + width - inner_hi > MAX_BORDER_COLUMNS:
            raise NotTileable("too many border columns to write out one by one")
        col = var(self.names("x"), max(inner_hi - inner_lo, 1), inner_lo)
        per_ky: list[ir.Stmt] = []
        if inner_hi > inner_lo:
            every_tap = list(range(w.kernel[1]))
            per_ky.append(ir.Loop(col, iconst(inner_lo), iconst(inner_hi),
                                  [ir.ArrayStore(row, col, taps_sum(col, every_tap))], simd=True))
        for x in [*range(inner_lo), *range(inner_hi, width)]:
            per_ky.append(ir.ArrayStore(row, iconst(x), taps_sum(iconst(x), valid(x))))
        taps_lo, taps_hi = valid_taps(w, 0, y)
        reduction = ir.Loop(ci, iconst(0), iconst(cg), [ir.Loop(ky, taps_lo, taps_hi, per_ky)])
        col2 = var(self.names("x"), width)
        value = array_load(row, "float32", col2)
        bias = self._bias(op, m)
        if bias is not None:
            value = binary("add", value, bias)
        zero = ir.Loop(col2, iconst(0), iconst(width),
                       [ir.ArrayStore(row, col2, const(0, "float32"))], simd=True)
        store = ir.Loop(col2, iconst(0), iconst(width),
                        self._conv_result(op, dest, into_window, m, y, col2, value), simd=True)
        return [ir.Loop(m, iconst(0), iconst(m_total),
                        [ir.Loop(r, iconst(0), iconst(n),
                                 [ir.DeclArray(row, "float32", width), zero, reduction, store])])]


def lower_tiled(graph: Graph, block: Block, symbol: str, schedule: Schedule, stage
                ) -> LoweredBlock | None:
    """The block as one tiled stage, or None when its plan does not ask for one or the stage
    has a form this generator does not produce (the usual lowering then runs)."""
    if stage is None or not getattr(stage, "tiled", False):
        return None
    try:
        return TiledLowering(graph, block, symbol, schedule, stage).lower()
    except NotTileable:
        return None

