"""The GPU printer: what OpenCL and CUDA share (`render/opencl.py`, `render/cuda.py` subclass it).

A kernel's stages become device entry points, launched one after another (`kernel.Launch`):

* a stage's top-level loop marked `parallel` (with the `parallel - 1` loops it collapses) becomes
  a 1-D range of work-items, one per iteration of the collapsed nest: the work-item's id is split
  back into the loop variables by division (the loops' bounds must be constants);
* statements a stage runs in order (a loop that is not parallel, a reduction into one value, an
  LSTM's time steps) run on one work-item, the loops inside them sequential;
* a stage whose top level declares mutable state (an accumulator, a local array) that later
  statements use runs whole on one work-item, so that state stays in one work-item's registers.

The named values (`Let`s) at a stage's top level are repeated in every entry point that follows
them; they only read what earlier entry points wrote (`passes.bind_values` never shares a value
across a write to what it read).

Local arrays live in each work-item's private memory (registers where small), except a
work-group's (`ir.DeclArray` scope "group": local/shared memory), declared at the entry point's top.
A parallel loop with `ir.Loop.work_group` runs in work-groups of that size (`Launch.work_group`),
whose work-items meet at `ir.Barrier`s: the GEMMs' form (`kiln.codegen.gemm.group`). GEMM
micro-kernel calls become a register-tiled function: an `mr` × `nr` tile of accumulators in
vector registers, reading A and B from global or (`MicroKernel.local`) local memory.

What differs between GPU languages is in hooks: the entry point's qualifier, the address-space
qualifiers of global and local pointers and of a work-group's arrays, the barrier, how a buffer
argument is passed and reached (`params`, `buffer`), the work-item id, the vector types and their
loads and stores, and math function names.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kiln.codegen import cmath, ir
from kiln.codegen.expr import Expr
from kiln.codegen.kernel import Launch
from kiln.codegen.microkernel import MicroKernel, register_tile_body
from kiln.codegen.render.cstyle import HELPERS, CStyleRenderer, _guarded, _indent
from kiln.codegen.schedule import Schedule

# Schedule for GPUs: every loop that may run in parallel does, collapsed as deep as it goes (many
# small work-items); every float contraction, however thin (a matrix-vector product included), a
# work-group tiled GEMM (`kiln.codegen.gemm.group`; its sizes from the target's limits,
# `Schedule.for_device`; without work-groups, packed-GEMM tasks of one micro-tile); small private
# tiles elsewhere.
# Neither AGO's intensive fusion nor fused attention: their tiles (a CPU cache's) are a work-item's
# private arrays here, which the micro-kernel (reading global memory) cannot take as operands.
GPU_SCHEDULE = Schedule(parallel_min_work=1, parallel_min_iterations=1 << 30, gemm_min_m=1,
                        gemm_min_n=1, gemm_mc=1, gemm_nc=1, matmul_tile_m=4, matmul_tile_n=16,
                        conv_tile_w=32, intensive_fusion=False, fused_attention=False)

WORK_ITEM = "kiln_wi"  # the name of the work-item id in an entry point


@dataclass(frozen=True)
class EntryPoint:
    """A stage's entry point as rendered: its body's lines, its launch's work-items and
    work-group size (0: any), and the declarations of its work-group arrays (at its top)."""

    lines: list[str]
    work_items: int
    work_group: int
    group_arrays: list[str]


class GpuRenderer(CStyleRenderer):
    """Renders a kernel as device entry points (see the module docstring); `launches` lists them
    after `kernel`."""

    kernel_qualifier = "__kernel void"
    global_space = "__global"  # address-space qualifier of a pointer into device memory
    prelude: tuple[str, ...] = ()  # lines before every kernel's definitions, behind one guard
    math_names: dict[str, str] = {}  # C math function (double name) -> this language's, overloaded

    local_space = "__local"  # qualifier of a work-group's arrays (`ir.DeclArray` scope "group")
    local_pointer_space = "__local"  # address-space qualifier of a pointer into them

    def __init__(self) -> None:
        super().__init__()
        self.launches: tuple[Launch, ...] = ()
        self.group_arrays: list[str] = []  # of the entry point being rendered

    # --- hooks a GPU renderer overrides ------------------------------------------------------
    def work_item_id(self) -> str:
        """The expression of the global 1-D work-item (thread) id."""
        raise NotImplementedError

    def params(self, position: int) -> list[str]:
        """The parameters through which argument `position` of the kernel ABI arrives."""
        raise NotImplementedError

    def argument(self, position: int) -> str:
        """An expression of type `unsigned char *` (in global space) for argument `position`."""
        raise NotImplementedError

    def vector_type(self, scalar: str, lanes: int) -> str:
        return f"{scalar}{lanes}"

    def vector_load(self, scalar: str, lanes: int, pointer: str) -> str:
        raise NotImplementedError

    def vector_store(self, scalar: str, lanes: int, value: str, pointer: str) -> str:
        raise NotImplementedError

    def vector_zero(self, scalar: str, lanes: int) -> str:
        raise NotImplementedError

    def function_qualifier(self) -> str:
        """The qualifier of a helper function the entry points call."""
        return "static inline"

    # --- buffers ------------------------------------------------------------------------------
    def buffer(self, buf: ir.Buffer, position: int, kernel: ir.KernelIR) -> str:
        t = self.types[buf.dtype]
        const = "const " if buf.role == "input" else ""
        pointer = f"{self.global_space} {const}{t} *"
        if buf.role == "scratch":
            base = f"({self.argument(_scratch_position(kernel))} + {buf.scratch_offset})"
        else:
            base = self.argument(position)
        return f"{pointer}{buf.name} = ({pointer}){base};"

    def signature(self, symbol: str, kernel: ir.KernelIR | None = None) -> str:
        positions = range(_argument_count(kernel)) if kernel is not None else range(0)
        params = [p for i in positions for p in self.params(i)]
        return f"{self.kernel_qualifier} {symbol}({', '.join(params)})"

    def local_array(self, stmt: ir.DeclArray) -> str:
        return f"{self.types[stmt.dtype]} {stmt.name}[{stmt.size}];"

    def statement(self, stmt: ir.Stmt) -> list[str]:
        if isinstance(stmt, ir.DeclArray) and stmt.scope == "group":
            # at the entry point's top: OpenCL allows local variables only at kernel scope
            self.group_arrays.append(f"{self.local_space} {self.local_array(stmt)}")
            return []
        return super().statement(stmt)

    # --- kernel -------------------------------------------------------------------------------
    def kernel(self, kernel: ir.KernelIR, comment: str) -> str:
        launches: list[Launch] = []
        entries: list[str] = []
        declarations = [self.buffer(buf, i, kernel) for i, buf in enumerate(kernel.buffers)]
        for stage in kernel.stages:
            for point in self.entry_points(stage.body):
                suffix = f"_g{len(launches)}"
                launches.append(Launch(suffix, point.work_items, point.work_group))
                entries += [f"/* {stage.comment} */",
                            self.signature(kernel.symbol + suffix, kernel) + " {",
                            *_indent(point.group_arrays + declarations), *_indent(point.lines),
                            "}"]
        self.launches = tuple(launches)
        head = [f"/* {comment} */", *_guarded("KILN_GPU_PRELUDE", "\n".join(self.prelude))]
        for name in sorted(self.helpers):
            head += _guarded(f"KILN_HELPER_{name.upper()}", _helper(name, self))
        for name, text in sorted(self.micro_kernels.items()):
            head += _guarded(f"KILN_HELPER_{name.upper()}", text)
        return "\n".join(head + entries + [""])

    def entry_points(self, body: list[ir.Stmt]) -> list[EntryPoint]:
        """The entry points of one stage, in launch order."""
        if any(isinstance(s, (ir.DeclAcc, ir.DeclArray)) for s in body):
            return [self.entry(self.sequential, body)]
        points: list[EntryPoint] = []
        named: list[ir.Stmt] = []  # the top-level Lets so far
        pending: list[ir.Stmt] = []  # statements that run in order, not yet emitted
        for stmt in body:
            if isinstance(stmt, ir.Let):
                (pending if pending else named).append(stmt)
                continue
            nest = _parallel_nest(stmt)
            if nest is None:
                pending.append(stmt)
                continue
            if pending:
                points.append(self.entry(self.sequential, named + pending))
                named, pending = named + [s for s in pending if isinstance(s, ir.Let)], []
            points.append(self.entry(self.parallel, named, nest))
        if pending:
            points.append(self.entry(self.sequential, named + pending))
        return points

    def entry(self, render: Callable[..., tuple[list[str], int, int]], *args) -> EntryPoint:
        """One entry point `render(*args)` renders, with the work-group arrays it declared."""
        self.group_arrays = []
        lines, work_items, work_group = render(*args)
        return EntryPoint(lines, work_items, work_group, self.group_arrays)

    def sequential(self, body: list[ir.Stmt]) -> tuple[list[str], int, int]:
        return ([f"if ({self.work_item_id()} == 0) {{", *_indent(self.statements(body)), "}"],
                1, 0)

    def parallel(self, named: list[ir.Stmt], nest: list[ir.Loop]) -> tuple[list[str], int, int]:
        """The collapsed loops `nest` as a range of work-items, one per iteration, in the
        outer loop's work-groups if it has them (its extent is a multiple of their size)."""
        extents = [loop.static_extent for loop in nest]
        total = 1
        for extent in extents:
            total *= extent
        work_group = nest[0].work_group
        if work_group and (len(nest) > 1 or total % work_group):
            raise ValueError(f"a loop of {total} iterations cannot run in work-groups of "
                             f"{work_group}")
        lines = [f"const {self.index_type} {WORK_ITEM} = {self.work_item_id()};",
                 f"if ({WORK_ITEM} < {total}) {{"]
        inner = []
        stride = total
        for loop, extent in zip(nest, extents):
            stride //= extent
            value = WORK_ITEM if stride == 1 else f"{WORK_ITEM} / {stride}"
            if stride * extent != total:
                value = f"({value}) % {extent}"
            inner.append(f"const {self.index_type} {loop.var.name} = {loop.start.value} + "
                         f"{value};")
        inner += self.statements(named) + self.statements(nest[-1].body)
        return lines + _indent(inner) + ["}"], total, work_group

    # --- micro-kernels ------------------------------------------------------------------------
    def micro_kernel(self, k: MicroKernel) -> str:
        """The register-tiled GEMM micro-kernel: `mr` × `nr / lanes` vector accumulators."""
        s, g, lanes = k.scalar, self.global_space, k.lanes
        operands = self.local_pointer_space if k.local else g  # where A and B are
        # an indirect kernel reads B rows at b + rows[k]: an int32 offset table in global memory
        rows = f"{g} const int *rows" if k.indirect else f"{self.index_type} ldb"
        head = (f"{self.function_qualifier()} void {k.function}({self.index_type} kc, "
                f"{operands} const {s} *a, {operands} const {s} *b, {rows}, {s} *c, "
                f"{self.index_type} ldc, int accumulate) {{")
        body = register_tile_body(
            k, self.vector_type(s, lanes), self.index_type,
            load=lambda pointer: self.vector_load(s, lanes, pointer),
            store=lambda value, pointer: self.vector_store(s, lanes, value, pointer),
            zero=self.vector_zero(s, lanes))
        return "\n".join([head, *body, "}"])

    # --- expressions --------------------------------------------------------------------------
    def render(self, e: Expr, a: list[str]) -> str:
        rule = GPU_OPS.get(e.op)
        return rule(self, e, a) if rule is not None else super().render(e, a)

    def call(self, e: Expr, a: list[str]) -> str:
        libm = cmath.in_libm_terms(e)
        if libm is not e:
            return self.expr(libm)
        return f"{self.math_names.get(e.attr, e.attr)}({', '.join(a)})"

    def bitcast(self, e: Expr, a: list[str]) -> str:
        raise NotImplementedError


GPU_OPS: dict[str, Callable[[GpuRenderer, Expr, list[str]], str]] = {
    "bitcast": lambda r, e, a: r.bitcast(e, a),
}


def _helper(name: str, renderer: GpuRenderer) -> str:
    """A shared integer helper (`cstyle.HELPERS`) with this language's function qualifier."""
    return HELPERS[name].replace("static inline", renderer.function_qualifier())


def _parallel_nest(stmt: ir.Stmt) -> list[ir.Loop] | None:
    """The loops a parallel top-level loop collapses, as far as their bounds are constants."""
    if not isinstance(stmt, ir.Loop) or not stmt.parallel:
        return None
    nest: list[ir.Loop] = []
    loop: ir.Stmt = stmt
    for _ in range(stmt.parallel):
        if not (isinstance(loop, ir.Loop) and loop.start.is_const and loop.static_extent):
            break
        nest.append(loop)
        if len(loop.body) != 1:
            break
        loop = loop.body[0]
    return nest or None


def _argument_count(kernel: ir.KernelIR) -> int:
    """Arguments of the kernel ABI: the buffers it is passed, then the scratch memory if any."""
    return _scratch_position(kernel) + (1 if kernel.scratch_bytes > 0 else 0)


def _scratch_position(kernel: ir.KernelIR) -> int:
    return sum(1 for b in kernel.buffers if b.role != "scratch")

