"""Fused epilogues the packed GEMM's micro-kernel applies to its accumulators in registers (a bias
per output channel or per column, ReLU, Clip, scaling, a LeakyReLU's select) against
onnxruntime: ragged rows and columns (the edge tiles still go through the local tile), the sum
split over several slices (partial sums stored, the epilogue applied on the last only), folded
batches; the epilogues that must not run there (another tensor read whole, a function called);
the kernels' source compiling for every ISA's vector width."""
from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper

from kiln.codegen.microkernel import MicroKernel, TileEpilogue, vector_extension_source
from kiln.codegen.schedule import Schedule
from tests.codegen.harness import avx2_micro_kernel, model
from tests.codegen.test_packed_gemm import TILES, run_with


def packed_stage(kernels) -> dict:
    return next(s for k in kernels for s in k.schedule["stages"] if s.get("form") == "packed")


def has_whole_tiles(stage: dict, columns: int) -> bool:
    mr, nr = map(int, stage["micro_kernel"].split("x"))
    return stage["product_rows"] >= mr and columns >= nr


def several_slices(tile, **extra) -> Schedule:
    """Blocks of two micro-tiles each way and slices of the sum 5 long: every product below has
    several blocks on each axis, ragged last ones, and several slices of the sum."""
    vb, mr, nr = tile
    return Schedule(vector_bytes=vb, gemm_mr=mr, gemm_nr=nr, gemm_mc=2 * mr, gemm_nc=2 * nr,
                    gemm_kc=5, gemm_l2_bytes=0, **extra)


def conv_nodes(activation: str) -> list:
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"])]
    if activation == "clip":
        return nodes + [helper.make_node("Clip", ["c", "lo", "hi"], ["y"])]
    if activation == "relu":
        return nodes + [helper.make_node("Relu", ["c"], ["y"])]
    if activation == "leaky":
        return nodes + [helper.make_node("LeakyRelu", ["c"], ["y"], alpha=0.1)]
    return nodes + [helper.make_node("Mul", ["c", "scale"], ["s"]),
                    helper.make_node("Max", ["s", "lo"], ["y"])]


@pytest.mark.parametrize("activation", ["clip", "relu", "leaky", "scale_max"])
@pytest.mark.parametrize("tile", TILES, ids=lambda t: f"{t[1]}x{t[2]}v{t[0]}")
def test_per_channel_bias_and_activation_in_registers(tile, activation):
    """A 1 × 1 conv (output channels as rows: the bias one value per row) with a bias and an
    activation: whole tiles finish in registers, over a sum in three slices (the last one
    short), rows and columns ragged (max(2·mr, nr) + 5 channels, 99 pixels)."""
    _, mr, nr = tile
    channels, k, pixels = max(2 * mr, nr) + 5, 13, (9, 11)
    spec = {"x": ((1, k, *pixels), "float32")}
    rng = np.random.default_rng(channels * 100 + k)
    constants = {"w": rng.standard_normal((channels, k, 1, 1)).astype(np.float32),
                 "b": rng.standard_normal(channels).astype(np.float32),
                 "lo": np.float32(-0.5), "hi": np.float32(1.5), "scale": np.float32(0.75)}
    kernels = run_with(model(conv_nodes(activation), spec, ["y"], constants), spec,
                       several_slices(tile))
    stage = packed_stage(kernels)
    assert stage["kc"] == 5
    assert (stage["epilogue"], stage["whole_tiles"]) == ("in registers",
                                                         "stored by the micro-kernel")


@settings(max_examples=8, deadline=None)
@given(batch=st.integers(1, 3), m=st.integers(4, 30), k=st.integers(6, 20),
       n=st.integers(8, 70), tile=st.sampled_from(TILES))
def test_per_column_bias_over_a_folded_batch_in_registers(batch, m, k, n, tile):
    """MatMul + bias + ReLU of activations times weights (a transformer's linear layer): the bias
    one value per column, loaded as vectors, the batch folded into the rows."""
    spec = {"a": ((batch, m, k), "float32")}
    rng = np.random.default_rng(batch * 1000 + m * 41 + k * 7 + n)
    constants = {"w": rng.standard_normal((k, n)).astype(np.float32),
                 "bias": rng.standard_normal(n).astype(np.float32)}
    nodes = [helper.make_node("MatMul", ["a", "w"], ["h"]),
             helper.make_node("Add", ["h", "bias"], ["hb"]),
             helper.make_node("Relu", ["hb"], ["y"])]
    stage = packed_stage(run_with(model(nodes, spec, ["y"], constants), spec,
                                  several_slices(tile)))
    if has_whole_tiles(stage, n):
        assert stage["epilogue"] == "in registers"


@pytest.mark.parametrize("tile", TILES, ids=lambda t: f"{t[1]}x{t[2]}v{t[0]}")
def test_a_value_per_row_of_a_folded_product_stays_per_block(tile):
    """Rows that run across the batch: a value per row of each batch (an (m, 1) tensor added)
    moves within a tile in no fixed stride, so that epilogue runs per block, and still matches."""
    spec = {"a": ((3, 7, 11), "float32")}
    rng = np.random.default_rng(5)
    constants = {"w": rng.standard_normal((11, 40)).astype(np.float32),
                 "r": rng.standard_normal((7, 1)).astype(np.float32)}
    nodes = [helper.make_node("MatMul", ["a", "w"], ["h"]),
             helper.make_node("Add", ["h", "r"], ["y"])]
    stage = packed_stage(run_with(model(nodes, spec, ["y"], constants), spec,
                                  several_slices(tile)))
    assert stage["epilogue"] == "per block"


@pytest.mark.parametrize("op", ["Tanh", "Sigmoid"])
def test_an_epilogue_that_calls_a_function_stays_per_block(op):
    spec = {"a": ((20, 13), "float32")}
    rng = np.random.default_rng(6)
    constants = {"w": rng.standard_normal((13, 40)).astype(np.float32),
                 "bias": rng.standard_normal(40).astype(np.float32)}
    nodes = [helper.make_node("MatMul", ["a", "w"], ["h"]),
             helper.make_node("Add", ["h", "bias"], ["hb"]),
             helper.make_node(op, ["hb"], ["y"])]
    stage = packed_stage(run_with(model(nodes, spec, ["y"], constants), spec,
                                  several_slices(TILES[1])))
    assert stage["epilogue"] == "per block"


def test_float64_bias_and_clip_in_registers():
    spec = {"a": ((2, 9, 11), "float64")}
    rng = np.random.default_rng(7)
    constants = {"w": rng.standard_normal((11, 21)), "bias": rng.standard_normal(21),
                 "lo": np.float64(-0.5), "hi": np.float64(1.0)}
    nodes = [helper.make_node("MatMul", ["a", "w"], ["h"]),
             helper.make_node("Add", ["h", "bias"], ["hb"]),
             helper.make_node("Clip", ["hb", "lo", "hi"], ["y"])]
    stage = packed_stage(run_with(model(nodes, spec, ["y"], constants), spec,
                                  several_slices((32, 6, 16))))
    assert stage["epilogue"] == "in registers"


def test_min_and_max_with_constants_in_registers():
    spec = {"a": ((12, 9), "float32")}
    rng = np.random.default_rng(8)
    constants = {"w": rng.standard_normal((9, 32)).astype(np.float32),
                 "lo": np.float32(0.25), "hi": np.float32(0.5)}
    nodes = [helper.make_node("MatMul", ["a", "w"], ["h"]),
             helper.make_node("Max", ["h", "lo"], ["m"]),
             helper.make_node("Min", ["m", "hi"], ["y"])]
    m = model(nodes, spec, ["y"], constants)
    stage = packed_stage(run_with(m, spec, several_slices(TILES[1])))
    assert stage["epilogue"] == "in registers"


# A bias per row, a bias per column, a scalar; clipped and scaled, as the packed GEMM builds it.
EPILOGUE = TileEpilogue(
    ("max", ("mul", ("add", ("add", ("total",), ("operand", 0)), ("operand", 1)), ("operand", 2)),
     ("select", ("lt", ("total",), ("const", 0.0)), ("const", -1.5), ("const", 2.0))),
    ((1, 0), (0, 1), (0, 0)))


@pytest.mark.parametrize("compiler,flags,vector_bytes,mr,nr", [
    ("gcc", ("-mavx2", "-mfma"), 32, 6, 16),
    ("gcc", ("-mavx512f",), 64, 12, 32),
    ("gcc", (), 16, 4, 8),  # baseline x86-64: SSE2 only
    ("aarch64-linux-gnu-gcc", ("-march=armv8-a",), 16, 8, 12),
])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_epilogue_kernels_compile_for_every_isa(compiler, flags, vector_bytes, mr, nr, dtype,
                                                tmp_path):
    if shutil.which(compiler) is None:
        pytest.skip(f"no {compiler}")
    kernel = MicroKernel(dtype, mr, nr if dtype == "float32" else nr // 2 * 2, vector_bytes,
                         epilogue=EPILOGUE)
    source = vector_extension_source(kernel)
    assert "if (finish)" in source
    path = tmp_path / "ukr.c"
    path.write_text("#include <stdint.h>\n" + source + "\n")
    subprocess.run([compiler, *flags, "-O2", "-Werror", "-c", str(path), "-o",
                    str(tmp_path / "ukr.o")], check=True, capture_output=True)


def test_epilogue_kernel_computes_what_its_tree_says(tmp_path):
    """The micro-kernel with `EPILOGUE`, called with and without `finish`, against numpy."""
    import ctypes

    fn = avx2_micro_kernel(MicroKernel("float32", 6, 16, 32, epilogue=EPILOGUE), tmp_path)
    rng = np.random.default_rng(9)
    kc, ldc = 7, 21
    a = rng.standard_normal((kc, 6)).astype(np.float32)  # packed panel: a[k·mr + r]
    b = rng.standard_normal((kc, 16)).astype(np.float32)
    b[3, 5] = np.nan  # max passes a NaN on, as the scalar code does
    rows = rng.standard_normal(6).astype(np.float32)
    cols = rng.standard_normal(16).astype(np.float32)
    scale = np.array([0.5], np.float32)
    total = a.T @ b
    with np.errstate(invalid="ignore"):
        expected = np.maximum((total + rows[:, None] + cols) * scale[0],
                              np.where(total < 0, -1.5, 2.0)).astype(np.float32)
    assert np.isnan(expected[:, 5]).all()
    p = ctypes.c_void_p
    for finish, want in ((1, expected), (0, total)):
        c = np.zeros((6, ldc), np.float32)
        fn(ctypes.c_int64(kc), p(a.ctypes.data), p(b.ctypes.data), ctypes.c_int64(16),
           p(c.ctypes.data), ctypes.c_int64(ldc), ctypes.c_int(0), p(rows.ctypes.data),
           p(cols.ctypes.data), p(scale.ctypes.data), ctypes.c_int(finish))
        np.testing.assert_allclose(c[:, :16], want, rtol=1e-5, atol=1e-5)
        assert not c[:, 16:].any()
