"""The transposed copy of a GEMM's local tile (`ir.Transpose`, `microkernel.transpose_source`):
the C helper against numpy for every vector width and both float types, blocks that are and are
not whole vectors; and a conv with its pixels as the product's rows, whose block epilogue reads
the tile through it, against onnxruntime."""
from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest
from onnx import helper

from kiln.codegen.microkernel import transpose_source
from kiln.codegen.schedule import Schedule
from tests.codegen.harness import model
from tests.codegen.test_packed_gemm import run_with

WIDTHS = [("float32", 64), ("float32", 32), ("float32", 16), ("float64", 64), ("float64", 16)]


def _helper_library(tmp_path, dtype: str, vector_bytes: int) -> ctypes.CDLL:
    name, source = transpose_source(dtype, vector_bytes)
    scalar = "float" if dtype == "float32" else "double"
    path = tmp_path / "transpose.c"
    path.write_text(f"#include <stdint.h>\n{source}\n"
                    f"void run(const {scalar} *s, int64_t lds, {scalar} *d, int64_t ldd, "
                    f"int64_t rows, int64_t cols) {{ {name}(s, lds, d, ldd, rows, cols); }}\n")
    library = tmp_path / "transpose.so"
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", str(path), "-o", str(library)], check=True)
    return ctypes.CDLL(str(library))


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc")
@pytest.mark.parametrize("dtype,vector_bytes", WIDTHS)
def test_the_helper_transposes_whole_blocks_and_edges(dtype, vector_bytes, tmp_path):
    """dst[c·ldd + r] = src[r·lds + c] for every r < rows, c < cols, nothing else written; rows
    and columns from fewer than one vector's lanes to several blocks and a ragged edge."""
    run = _helper_library(tmp_path, dtype, vector_bytes).run
    lanes = vector_bytes // np.dtype(dtype).itemsize
    rng = np.random.default_rng(lanes)
    for rows, cols in [(1, 1), (lanes - 1, lanes + 1), (lanes, lanes), (3 * lanes + 1, 2 * lanes),
                       (49, 128), (2 * lanes, 5)]:
        lds, ldd = cols + 3, -(-rows // lanes) * lanes + lanes
        src = rng.standard_normal((rows, lds)).astype(dtype)
        dst = np.full((cols + 2, ldd), -7.0, dtype)
        pointer = ctypes.c_void_p
        run(pointer(src.ctypes.data), ctypes.c_int64(lds), pointer(dst.ctypes.data),
            ctypes.c_int64(ldd), ctypes.c_int64(rows), ctypes.c_int64(cols))
        np.testing.assert_array_equal(dst[:cols, :rows], src[:, :cols].T)
        assert (dst[:cols, rows:] == -7).all() and (dst[cols:] == -7).all()


@pytest.mark.skipif(shutil.which("aarch64-linux-gnu-gcc") is None, reason="no aarch64 gcc")
def test_the_helper_compiles_for_neon(tmp_path):
    name, source = transpose_source("float32", 16)
    path = tmp_path / "transpose.c"
    path.write_text(f"#include <stdint.h>\n{source}\n"
                    f"void run(const float *s, float *d) {{ {name}(s, 8, d, 8, 8, 8); }}\n")
    subprocess.run(["aarch64-linux-gnu-gcc", "-march=armv8-a", "-O2", "-c", str(path), "-o",
                    str(tmp_path / "transpose.o")], check=True)


@pytest.mark.parametrize("size,channels,tail", [((7, 7), (96, 512), "clip"),
                                                ((14, 14), (576, 96), "residual"),
                                                ((9, 9), (384, 64), "relu")])
def test_a_conv_by_pixel_rows_reads_its_block_transposed(size, channels, tail):
    """A 1 × 1 conv with its pixels as rows and a block epilogue (its output runs along the
    pixels) copies each block transposed, then applies bias and epilogue along the pixels."""
    rng = np.random.default_rng(size[0])
    (cin, cout) = channels
    spec = {"x": ((1, cin, *size), "float32")}
    constants = {"w": rng.standard_normal((cout, cin, 1, 1)).astype(np.float32),
                 "b": rng.standard_normal(cout).astype(np.float32),
                 "lo": np.float32(-0.5), "hi": np.float32(1.5)}
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"])]
    if tail == "clip":
        nodes.append(helper.make_node("Clip", ["c", "lo", "hi"], ["y"]))
    elif tail == "relu":
        nodes.append(helper.make_node("Relu", ["c"], ["y"]))
    else:
        spec["r"] = ((1, cout, *size), "float32")
        nodes.append(helper.make_node("Add", ["c", "r"], ["y"]))
    kernels = run_with(model(nodes, spec, ["y"], constants), spec,
                       Schedule(vector_bytes=64, gemm_mr=12, gemm_nr=32))
    stage = next(s for k in kernels for s in k.schedule["stages"] if s.get("form") == "packed")
    assert stage["epilogue"] == "per block"
    assert any("kiln_transpose_float32_v64(" in k.source for k in kernels)
