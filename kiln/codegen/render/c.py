"""C for x86-64 and aarch64 alike (the same portable C; the target only picks compiler flags,
which the toolchain adds): the C-family printer plus the kernel ABI of `kiln.codegen`, Kiln's
thread pool for parallel loops, OpenMP's `simd` for vector loops, and GCC-vector-extension GEMM
micro-kernels.

A parallel loop nest is outlined: its body becomes a function of a range of the (collapsed)
iterations, `<kernel>_p<n>`, that reads what it uses of the kernel's names from a context struct
the kernel fills, and the kernel hands it to `kiln_parallel_for` (`pool.c`, carried by every
kernel's source), which runs it on the pool's threads and returns when all iterations are done.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from importlib import resources

from kiln.codegen import ir
from kiln.codegen.microkernel import MicroKernel, transpose_source, vector_extension_source
from kiln.codegen.render.cstyle import CStyleRenderer

CHUNKS_PER_LOOP = 32  # "chunks" grain: dynamic chunks of about 1/32 of the iterations
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
POOL_MODES = {"dynamic": "KILN_POOL_DYNAMIC", "even": "KILN_POOL_EVEN",
              "cyclic": "KILN_POOL_CYCLIC"}


@cache
def pool_source() -> str:
    """Kiln's thread pool (C; weak definitions behind a guard, so every kernel can carry it)."""
    return resources.files("kiln.codegen.render").joinpath("pool.c").read_text()


@dataclass(frozen=True)
class Capture:
    """How an outlined loop body reaches one of the kernel's names: the context struct's member
    and the body's local declaration of the same name."""

    member: str
    local: str


class CRenderer(CStyleRenderer):
    def __init__(self) -> None:
        super().__init__()
        self.symbol = ""
        self.outlined = 0  # parallel nests outlined so far
        self.scopes: list[dict[str, Capture]] = [{}]  # the names declared where the printer is

    def kernel(self, kernel: ir.KernelIR, comment: str) -> str:
        self.symbol = kernel.symbol
        return super().kernel(kernel, comment)

    def signature(self, symbol: str) -> str:
        return f"void {symbol}(void *const *args)"

    def buffer(self, buf: ir.Buffer, position: int, kernel: ir.KernelIR) -> str:
        t = self.types[buf.dtype]
        const = "const " if buf.role == "input" else ""
        self.declare(buf.name, Capture(f"{const}{t} *{buf.name};",
                                       f"{const}{t} *restrict {buf.name} = kiln_c->{buf.name};"))
        if buf.role == "input":
            return f"const {t} *restrict {buf.name} = (const {t} *)args[{position}];"
        if buf.role == "output":
            return f"{t} *restrict {buf.name} = ({t} *)args[{position}];"
        scratch_arg = sum(1 for b in kernel.buffers if b.role != "scratch")
        return (f"{t} *restrict {buf.name} = ({t} *)((char *)args[{scratch_arg}] + "
                f"{buf.scratch_offset});")

    # --- scopes: what an outlined body may capture ------------------------------------------
    def declare(self, name: str, capture: Capture) -> None:
        self.scopes[-1][name] = capture

    def visible(self, name: str) -> Capture | None:
        for scope in reversed(self.scopes):
            if name in scope:
                return scope[name]
        return None

    def statements(self, body: list[ir.Stmt]) -> list[str]:
        self.scopes.append({})
        try:
            return super().statements(body)
        finally:
            self.scopes.pop()

    def statement(self, stmt: ir.Stmt) -> list[str]:
        lines = super().statement(stmt)
        if isinstance(stmt, (ir.Let, ir.DeclAcc)):
            value = stmt.local if isinstance(stmt, ir.Let) else stmt.acc
            t = self.types[value.dtype]
            self.declare(value.name, Capture(f"{t} {value.name};",
                                             f"const {t} {value.name} = kiln_c->{value.name};"))
        elif isinstance(stmt, ir.DeclArray):
            t = self.types[stmt.dtype]
            self.declare(stmt.name, Capture(f"{t} *{stmt.name};",
                                            f"{t} *{stmt.name} = kiln_c->{stmt.name};"))
        return lines

    def loop(self, loop: ir.Loop) -> list[str]:
        if loop.parallel:
            return self.outlined_loop(loop)
        self.scopes.append({loop.var.name: _index_capture(loop.var.name)})
        try:
            return super().loop(loop)
        finally:
            self.scopes.pop()

    # --- parallel loops: outlined, run by the pool ------------------------------------------
    def outlined_loop(self, loop: ir.Loop) -> list[str]:
        """The call that runs a parallel nest on the pool; its body goes to `definitions`."""
        if loop.reductions:
            raise ValueError(f"parallel loop over {loop.var.name} has reductions; the pool "
                             "runs none")
        nest = [loop]
        while len(nest) < loop.parallel:
            nest.append(nest[-1].body[0])
        bounds = [(self.expr(level.start), self.expr(level.stop)) for level in nest]
        self.scopes.append({level.var.name: _index_capture(level.var.name) for level in nest})
        try:
            body = self.statements(nest[-1].body)
        finally:
            self.scopes.pop()
        loop_vars = {level.var.name for level in nest}
        used = set(IDENTIFIER.findall("\n".join(body + [b for pair in bounds for b in pair])))
        captures = {name: c for name in sorted(used - loop_vars)
                    if (c := self.visible(name)) is not None}
        function = f"{self.symbol}_p{self.outlined}"
        if not self.outlined:
            self.definitions.append(pool_source())
        self.outlined += 1
        extents = [_extent(level, start, stop) for level, (start, stop) in zip(nest, bounds)]
        self.definitions.append(_outlined_function(function, nest, bounds, extents, captures,
                                                   body))
        mode, chunk = _pool_schedule(loop)
        members = ", ".join(f".{name} = {name}" for name in captures) or "0"
        return ["{", f"  const {function}_ctx kiln_c = {{{members}}};",
                f"  kiln_parallel_for({function}, &kiln_c, {' * '.join(extents)}, {chunk}, "
                f"{POOL_MODES[mode]});", "}"]

    def local_array(self, stmt: ir.DeclArray) -> str:
        return (f"{self.types[stmt.dtype]} {stmt.name}[{stmt.size}] "
                f"__attribute__((aligned({self.array_align})));")

    def micro_kernel(self, kernel: MicroKernel) -> str:
        return vector_extension_source(kernel)

    def transpose(self, dtype: str, vector_bytes: int) -> tuple[str, str]:
        return transpose_source(dtype, vector_bytes)

    def parallel_loop(self, loop: ir.Loop) -> list[str]:
        """OpenMP's `simd` (with its reductions) for a vector loop; parallel loops are outlined."""
        if not loop.simd:
            return []
        return [" ".join(["#pragma omp simd",
                          *(f"reduction({op}:{acc.name})" for op, acc in loop.reductions)])]


def _index_capture(name: str) -> Capture:
    return Capture(f"int64_t {name};", f"const int64_t {name} = kiln_c->{name};")


def _extent(loop: ir.Loop, start: str, stop: str) -> str:
    if loop.static_extent is not None:
        return str(max(loop.static_extent, 0))
    return f"(({stop}) > ({start}) ? ({stop}) - ({start}) : 0)"


def _outlined_function(function: str, nest: list[ir.Loop], bounds: list[tuple[str, str]],
                       extents: list[str], captures: dict[str, Capture], body: list[str]) -> str:
    """A parallel nest's body as a function of a range [kiln_begin, kiln_end) of its collapsed
    iterations (the last loop varies fastest), reading the captured names from its context."""
    members = [c.member for c in captures.values()] or ["char kiln_unused;"]
    lines = ["typedef struct {", *(f"  {m}" for m in members), f"}} {function}_ctx;",
             f"static void {function}(const void *kiln_context, int64_t kiln_begin, "
             "int64_t kiln_end) {",
             f"  const {function}_ctx *kiln_c = (const {function}_ctx *)kiln_context;"]
    lines += [f"  {c.local}" for c in captures.values()]
    lines += [f"  (void){name};" for name in captures]
    lines.append("  (void)kiln_c;")
    if len(nest) == 1:
        (start, _), v = bounds[0], nest[0].var.name
        if nest[0].simd:
            lines.append("  #pragma omp simd")
        lines.append(f"  for (int64_t {v} = ({start}) + kiln_begin; {v} < ({start}) + kiln_end; "
                     f"++{v}) {{")
    else:
        lines += [f"  const int64_t kiln_e{i} = {e};" for i, e in enumerate(extents)]
        lines += ["  for (int64_t kiln_i = kiln_begin; kiln_i < kiln_end; ++kiln_i) {",
                  "    int64_t kiln_rest = kiln_i;"]
        for i in range(len(nest) - 1, -1, -1):
            start, v = bounds[i][0], nest[i].var.name
            if i:
                lines += [f"    const int64_t {v} = ({start}) + kiln_rest % kiln_e{i};",
                          f"    kiln_rest /= kiln_e{i};"]
            else:
                lines.append(f"    const int64_t {v} = ({start}) + kiln_rest;")
    lines += [f"    {line}" if line else line for line in body]
    return "\n".join(lines + ["  }", "}"])


def _pool_schedule(loop: ir.Loop) -> tuple[str, int]:
    """How the pool hands out a parallel loop's grain (`kiln.codegen.ir.GRAINS`): "one" is one
    iteration at a time to whoever asks; "chunks" hands out chunks of about 1/CHUNKS_PER_LOOP of
    the (collapsed) iterations; "blocks" gives chunks of 1/`loop.blocks` of them to the threads in
    turn (chunk k to thread k mod threads, in every loop); "even" splits them evenly."""
    if loop.grain == "one":
        return "dynamic", 1
    if loop.grain == "chunks":
        return "dynamic", max(1, _iterations(loop, CHUNKS_PER_LOOP) // CHUNKS_PER_LOOP)
    if loop.grain == "blocks" and loop.blocks > 0:
        return "cyclic", max(1, -(-_iterations(loop, loop.blocks) // loop.blocks))
    return "even", 0


def _iterations(loop: ir.Loop, unknown: int) -> int:
    """Iterations of the collapsed parallel nest (`unknown` for a loop without a static extent)."""
    iterations, level = 1, loop
    for depth in range(max(loop.parallel, 1)):
        iterations *= level.static_extent or unknown
        if depth + 1 < loop.parallel:
            level = level.body[0]
    return iterations
