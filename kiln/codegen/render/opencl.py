"""OpenCL C (1.2 and later), for mobile GPUs (Adreno, Mali) and any OpenCL device (PoCL on a CPU):
the GPU printer with OpenCL's spelling. Each kernel ABI argument arrives as a `__global uchar *`
base and a byte offset (a region of the memory plan: the arena, the weights, an input), so the
host binds whole buffers once and needs no sub-buffers (whose offsets devices restrict)."""
from __future__ import annotations

from kiln.codegen.expr import Expr
from kiln.codegen.render.gpu import GpuRenderer

OPENCL_TYPES = {
    "float32": "float", "float64": "double", "bool": "uchar",
    "int8": "char", "int16": "short", "int32": "int", "int64": "long",
    "uint8": "uchar", "uint16": "ushort", "uint32": "uint", "uint64": "ulong",
}

# The C names the shared printer uses (`cstyle`) in OpenCL's types and overloaded built-ins.
PRELUDE = (
    "#ifdef cl_khr_fp64",
    "#pragma OPENCL EXTENSION cl_khr_fp64 : enable",
    "#endif",
    "typedef char int8_t;", "typedef short int16_t;", "typedef int int32_t;",
    "typedef long int64_t;", "typedef uchar uint8_t;", "typedef ushort uint16_t;",
    "typedef uint uint32_t;", "typedef ulong uint64_t;",
    "#define fabsf fabs", "#define fmodf fmod",
)


class OpenCLRenderer(GpuRenderer):
    types = OPENCL_TYPES
    kernel_qualifier = "__kernel void"
    global_space = "__global"
    prelude = PRELUDE
    math_names = {"nearbyint": "rint"}  # round half to even, OpenCL's default rounding

    def work_item_id(self) -> str:
        return "(int64_t)get_global_id(0)"

    def barrier(self) -> str:
        return "barrier(CLK_LOCAL_MEM_FENCE);"

    def params(self, position: int) -> list[str]:
        return [f"__global uchar *a{position}", f"ulong o{position}"]

    def argument(self, position: int) -> str:
        return f"(a{position} + o{position})"

    def vector_load(self, scalar: str, lanes: int, pointer: str) -> str:
        return f"vload{lanes}(0, {pointer})"

    def vector_store(self, scalar: str, lanes: int, value: str, pointer: str) -> str:
        return f"vstore{lanes}({value}, 0, {pointer})"

    def vector_zero(self, scalar: str, lanes: int) -> str:
        return f"(({scalar}{lanes})(0))"

    def bitcast(self, e: Expr, a: list[str]) -> str:
        return f"as_{self.types[e.dtype]}({a[0]})"
