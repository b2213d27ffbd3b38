"""CUDA C++, for NVIDIA GPUs: the GPU printer (`render/gpu.py`) with CUDA's spelling. Entry points
are `extern "C" __global__` functions (unmangled names, which the host driver looks up); each
kernel ABI argument arrives as one device pointer (the host adds a region's offset to its base,
CUdeviceptr arithmetic); the work-item id is the global thread index of a 1-D grid. CUDA's vector
types have no arithmetic, so the micro-kernel's vectors are a small template with the two
operators it uses; the loads and stores are element-wise (the compiler merges aligned ones)."""
from __future__ import annotations

from kiln.codegen.expr import Expr
from kiln.codegen.render.cstyle import C_TYPES
from kiln.codegen.render.gpu import GpuRenderer

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
    prelude = PRELUDE

    def work_item_id(self) -> str:
        return "((int64_t)blockIdx.x * blockDim.x + threadIdx.x)"

    def params(self, position: int) -> list[str]:
        return [f"unsigned char *a{position}"]

    def argument(self, position: int) -> str:
        return f"a{position}"

    def function_qualifier(self) -> str:
        return "static __device__ inline"

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
