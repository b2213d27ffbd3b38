"""C with OpenMP, for x86-64 and aarch64 alike (the same portable C; the target only picks compiler
flags, which the toolchain adds): the C-family printer plus the kernel ABI of `kiln.codegen`,
OpenMP for parallel and vector loops, and GCC-vector-extension GEMM micro-kernels."""
from __future__ import annotations

from kiln.codegen import ir
from kiln.codegen.microkernel import MicroKernel, vector_extension_source
from kiln.codegen.render.cstyle import CStyleRenderer

CHUNKS_PER_LOOP = 32  # "chunks" grain: dynamic chunks of about 1/32 of the iterations


class CRenderer(CStyleRenderer):
    def signature(self, symbol: str) -> str:
        return f"void {symbol}(void *const *args)"

    def buffer(self, buf: ir.Buffer, position: int, kernel: ir.KernelIR) -> str:
        t = self.types[buf.dtype]
        if buf.role == "input":
            return f"const {t} *restrict {buf.name} = (const {t} *)args[{position}];"
        if buf.role == "output":
            return f"{t} *restrict {buf.name} = ({t} *)args[{position}];"
        scratch_arg = sum(1 for b in kernel.buffers if b.role != "scratch")
        return (f"{t} *restrict {buf.name} = ({t} *)((char *)args[{scratch_arg}] + "
                f"{buf.scratch_offset});")

    def local_array(self, stmt: ir.DeclArray) -> str:
        return (f"{self.types[stmt.dtype]} {stmt.name}[{stmt.size}] "
                f"__attribute__((aligned({self.array_align})));")

    def micro_kernel(self, kernel: MicroKernel) -> str:
        return vector_extension_source(kernel)

    def parallel_loop(self, loop: ir.Loop) -> list[str]:
        """An OpenMP pragma: `parallel for` over the collapsed nest, `simd` with reductions."""
        clauses = []
        if loop.parallel:
            clauses.append("parallel for")
            if loop.simd and loop.parallel == 1:
                clauses.append("simd")
            clauses.append(_schedule_clause(loop))
            if loop.parallel > 1:
                clauses.append(f"collapse({loop.parallel})")
        elif loop.simd:
            clauses.append("simd")
        if loop.simd and (not loop.parallel or loop.parallel == 1):
            clauses += [f"reduction({op}:{acc.name})" for op, acc in loop.reductions]
        return ["#pragma omp " + " ".join(clauses)] if clauses else []


def _schedule_clause(loop: ir.Loop) -> str:
    """The OpenMP schedule of a parallel loop's grain (`kiln.codegen.ir.GRAINS`): "one" is
    `dynamic, 1`; "chunks" hands out chunks of about 1/CHUNKS_PER_LOOP of the (collapsed)
    iterations; "blocks" is `static` with chunks of 1/`loop.blocks` of them (chunk k goes to
    thread k mod threads in every loop); "even" is `static`."""
    if loop.grain == "one":
        return "schedule(dynamic, 1)"
    if loop.grain == "chunks":
        return f"schedule(dynamic, {max(1, _iterations(loop, CHUNKS_PER_LOOP) // CHUNKS_PER_LOOP)})"
    if loop.grain == "blocks" and loop.blocks > 0:
        return f"schedule(static, {max(1, -(-_iterations(loop, loop.blocks) // loop.blocks))})"
    return "schedule(static)"


def _iterations(loop: ir.Loop, unknown: int) -> int:
    """Iterations of the collapsed parallel nest (`unknown` for a loop without a static extent)."""
    iterations, level = 1, loop
    for depth in range(max(loop.parallel, 1)):
        iterations *= level.static_extent or unknown
        if depth + 1 < loop.parallel:
            level = level.body[0]
    return iterations
