"""CUDA C++, for NVIDIA GPUs: the GPU printer (`render/gpu.py`) with CUDA's spelling. Entry points
are `extern "C" __global__` functions (unmangled names, which the host driver looks up); each
kernel ABI argument arrives as one device pointer (the host adds a region's offset to its base,
CUdeviceptr arithmetic); the work-item id is the global thread index of a 1-D grid. CUDA's vector
types have no arithmetic, so the micro-kernel's vectors are a small template with the two
operators it uses; the loads and stores are element-wise (the compiler merges aligned ones).

Row stages run a warp per row: a parallel nest whose body reduces over the row (a vectorisable
loop with reductions, `ir.Loop.reductions`, beside the declarations of its accumulators) gets 32
threads per work-item. Every vectorisable loop at the level of its accumulators is shared among
the warp's lanes (lane, lane + 32, ...); after it each accumulator is combined across the lanes
with `__shfl_xor_sync` (a butterfly: every lane ends with the row's value), and `__syncwarp`
orders the lanes' memory accesses around it. The other statements run on every lane alike
(same values, same stores). Nests with private arrays or GEMM micro-tiles keep a thread per
work-item, as do accumulators of types the shuffle does not move.
"""
from __future__ import annotations

from kiln.codegen import ir
from kiln.codegen.expr import Expr
from kiln.codegen.render.cstyle import C_TYPES, _indent
from kiln.codegen.render.gpu import GpuRenderer

WARP = 32
LANE = "kiln_lane"
SHUFFLED_TYPES = frozenset({"float32", "float64", "int32", "int64", "uint32", "uint64"})
# How two lanes' partial values combine, by reduction clause (reduction.py's): `a` and `b`.
COMBINE = {"+": "a + b", "*": "a * b", "max": "(b > a ? b : a)", "min": "(b < a ? b : a)",
           "|": "(a | b)"}
# Clauses whose value before the loop must join once, not once per lane (max, min and | may
# repeat it).
IDENTITY = {"+": "0", "*": "1"}

PRELUDE = (
    "#include <stdint.h>",
    "#ifndef NAN",
    "#define NAN __int_as_float(0x7fffffff)",
    "#endif",
    "#ifndef INFINITY",
    "#define INFINITY __int_as_float(0x7f800000)",
    "#endif",
    "template <typename T, int N> struct kiln_vec { T v[N]; };",
    "template <typename T, int N>",
    "__device__ inline kiln_vec<T, N> kiln_vload(const T *p) {",
    "  kiln_vec<T, N> r;",
    "#pragma unroll",
    "  for (int i = 0; i < N; ++i) r.v[i] = p[i];",
    "  return r;",
    "}",
    "template <typename T, int N>",
    "__device__ inline void kiln_vstore(kiln_vec<T, N> x, T *p) {",
    "#pragma unroll",
    "  for (int i = 0; i < N; ++i) p[i] = x.v[i];",
    "}",
    "template <typename T, int N>",
    "__device__ inline kiln_vec<T, N> operator*(T a, kiln_vec<T, N> b) {",
    "#pragma unroll",
    "  for (int i = 0; i < N; ++i) b.v[i] = a * b.v[i];",
    "  return b;",
    "}",
    "template <typename T, int N>",
    "__device__ inline kiln_vec<T, N> &operator+=(kiln_vec<T, N> &a, kiln_vec<T, N> b) {",
    "#pragma unroll",
    "  for (int i = 0; i < N; ++i) a.v[i] += b.v[i];",
    "  return a;",
    "}",
    "#define KILN_WARP_REDUCE(name, combine) \\",
    "  template <typename T> __device__ inline T name(T a) { \\",
    "    for (int offset = 16; offset > 0; offset >>= 1) { \\",
    "      const T b = __shfl_xor_sync(0xffffffffu, a, offset); \\",
    "      a = combine; \\",
    "    } \\",
    "    return a; \\",
    "  }",
    *(f"KILN_WARP_REDUCE(kiln_warp_{i}, {rule})" for i, rule in enumerate(COMBINE.values())),
    "template <typename To, typename From> __device__ inline To kiln_bitcast(From from) {",
    "  To to;",
    "  memcpy(&to, &from, sizeof to);",
    "  return to;",
    "}",
)


class CudaRenderer(GpuRenderer):
    types = C_TYPES
    kernel_qualifier = 'extern "C" __global__ void'
    global_space = ""  # one address space for pointers: generic
    local_space = "__shared__"
    local_pointer_space = ""
    prelude = PRELUDE

    def __init__(self) -> None:
        super().__init__()
        self.warp = False  # rendering a nest with a warp per work-item

    def work_item_id(self) -> str:
        thread = "((int64_t)blockIdx.x * blockDim.x + threadIdx.x)"
        return f"({thread} / {WARP})" if self.warp else thread

    # --- a warp per row -----------------------------------------------------------------------
    def parallel(self, named: list[ir.Stmt], nest: list[ir.Loop]) -> tuple[list[str], int, int]:
        if nest[0].work_group or not _warp_rows(nest[-1].body):
            return super().parallel(named, nest)
        self.warp = True
        try:
            lines, work_items, _ = super().parallel(named, nest)
        finally:
            self.warp = False
        return [f"const int {LANE} = (int)(threadIdx.x % {WARP});", *lines], work_items * WARP, 0

    def statements(self, body: list[ir.Stmt]) -> list[str]:
        if not self.warp:
            return super().statements(body)
        declared = {s.acc.name for s in body if isinstance(s, ir.DeclAcc)}
        lines: list[str] = []
        for stmt in body:
            if _shared_loop(stmt, declared):
                lines += self.lane_loop(stmt)
            else:
                lines += self.statement(stmt)
        return lines

    def lane_loop(self, loop: ir.Loop) -> list[str]:
        """`loop` shared among the warp's lanes, its reductions combined across them."""
        v = loop.var.name
        header = (f"for ({self.index_type} {v} = {self.expr(loop.start)} + {LANE}; {v} < "
                  f"{self.expr(loop.stop)}; {v} += {WARP}) {{")
        before, combine = [], []
        for op, a in loop.reductions:
            reduced = f"kiln_warp_{list(COMBINE).index(op)}({a.name})"
            # Each lane starts from the identity and the value before joins once (a loop split
            # into pieces, passes.split_index_sets, reduces into one accumulator piece by piece).
            if op in IDENTITY:
                kept = f"{a.name}_before"
                before += [f"const {self.types[a.dtype]} {kept} = {a.name};",
                           f"{a.name} = {IDENTITY[op]};"]
                reduced = f"{kept} {op} {reduced}"
            combine.append(f"{a.name} = {reduced};")
        body = [*before, header, *_indent(self.statements(loop.body)), "}", *combine]
        return ["__syncwarp();", "{", *_indent(body), "}", "__syncwarp();"]

    def params(self, position: int) -> list[str]:
        return [f"unsigned char *a{position}"]

    def argument(self, position: int) -> str:
        return f"a{position}"

    def function_qualifier(self) -> str:
        return "static __device__ inline"

    def barrier(self) -> str:
        return "__syncthreads();"

    def vector_type(self, scalar: str, lanes: int) -> str:
        return f"kiln_vec<{scalar}, {lanes}>"

    def vector_load(self, scalar: str, lanes: int, pointer: str) -> str:
        return f"kiln_vload<{scalar}, {lanes}>({pointer})"

    def vector_store(self, scalar: str, lanes: int, value: str, pointer: str) -> str:
        return f"kiln_vstore<{scalar}, {lanes}>({value}, {pointer})"

    def vector_zero(self, scalar: str, lanes: int) -> str:
        return f"kiln_vec<{scalar}, {lanes}>{{}}"

    def bitcast(self, e: Expr, a: list[str]) -> str:
        return f"kiln_bitcast<{self.types[e.dtype]}>({a[0]})"


def _shared_loop(stmt: ir.Stmt, declared: set[str]) -> bool:
    """A vectorisable loop whose reductions' accumulators are declared beside it: its lanes
    can share its iterations and combine right after it."""
    return (isinstance(stmt, ir.Loop) and stmt.simd and not stmt.parallel
            and all(a.name in declared and a.dtype in SHUFFLED_TYPES and op in COMBINE
                    for op, a in stmt.reductions))


def _warp_rows(body: list[ir.Stmt]) -> bool:
    """Whether a parallel nest's body is a row stage a warp runs (see the module docstring)."""
    stmts = list(ir.iter_stmts(body))
    if any(isinstance(s, (ir.DeclArray, ir.ArrayStore, ir.MicroKernelCall, ir.Transpose))
           for s in stmts):
        return False

    def reduces(block: list[ir.Stmt]) -> bool:
        declared = {s.acc.name for s in block if isinstance(s, ir.DeclAcc)}
        return any((_shared_loop(s, declared) and s.reductions)
                   or any(reduces(child) for child in ir.children(s)) for s in block)

    return reduces(body)
