"""The direct conv with output pixels as rows and output channels in the vector lanes
(kiln.codegen.ops.conv_pixels) against onnxruntime: 7 × 7 and 14 × 14 images, groups of 16 to 64
channels (the input copied whole or by the tasks, a window of grid rows each), uneven pads,
batches, pixel counts that are not whole tiles, channels that are not whole panels, sums in
several slices, bias and ReLU or Clip in registers, a residual added in a pass of its own,
float64 against the ONNX reference; the micro-kernel's source for every ISA and what it
computes; the cost model's choice."""
from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest
from onnx import helper
from onnx.reference import ReferenceEvaluator

from kiln import frontend
from kiln.codegen import generate
from kiln.codegen.microkernel import MicroKernel, TileEpilogue, vector_extension_source
from kiln.codegen.expr import iconst
from kiln.codegen.gemm.packed import spread_ahead
from kiln.codegen.ops.conv_pixels import pixel_rows_wins
from kiln.codegen.ops.conv_window import Window
from kiln.codegen.schedule import Schedule
from kiln.target import target
from tests.codegen.harness import (
    assert_matches,
    avx2_micro_kernel,
    model,
    plan_for,
    prefetched_offsets,
    random_inputs,
    reference,
    run_kernels,
)

# The cost model picks among conv kernels by vector width: these cases are the choices of an
# AVX2 machine (8 lanes). The code runs on any x86-64 host with AVX2, AVX-512 ones included.
AVX2 = target("x86_64")

FORM = "direct, pixels as rows"


def _conv_model(n, cin, size, cout, kernel, group, pads, tail, dtype="float32", seed=3,
                stride=1):
    rng = np.random.default_rng(seed)
    h, w = size
    oh = (h + pads[0] + pads[2] - kernel) // stride + 1
    ow = (w + pads[1] + pads[3] - kernel) // stride + 1
    spec = {"x": ((n, cin, h, w), dtype)}
    constants = {"w": rng.standard_normal((cout, cin // group, kernel, kernel)).astype(dtype),
                 "b": rng.standard_normal(cout).astype(dtype)}
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[kernel, kernel],
                              pads=list(pads), group=group, strides=[stride, stride])]
    if tail == "relu":
        nodes.append(helper.make_node("Relu", ["c"], ["y"]))
    elif tail == "clip":
        constants.update(lo=np.array(-0.5, dtype), hi=np.array(1.5, dtype))
        nodes.append(helper.make_node("Clip", ["c", "lo", "hi"], ["y"]))
    elif tail == "residual":
        spec["r"] = ((n, cout, oh, ow), dtype)
        nodes += [helper.make_node("Add", ["c", "r"], ["s"]),
                  helper.make_node("Relu", ["s"], ["y"])]
    else:
        nodes.append(helper.make_node("Identity", ["c"], ["y"]))
    return model(nodes, spec, ["y"], constants), spec


def _run(onnx_model, spec, schedule: Schedule | None = None, want=None):
    inputs = random_inputs(spec)
    graph = frontend.build(onnx_model, {}, "t")
    plan = plan_for(graph, "dnnfusion")
    kernels = generate(plan, AVX2, schedule)
    values = run_kernels(plan, kernels, dict(zip(graph.inputs, inputs.values())))
    want = want(inputs) if want else reference(onnx_model, inputs)
    assert_matches([values[t] for t in graph.outputs], want)
    return [s for k in kernels for s in k.schedule["stages"] if s.get("form") == FORM]


CASES = [  # (batch, in channels, image, out channels, kernel, groups, pads, tail)
    (1, 64, (7, 7), 64, 5, 1, (2, 2, 2, 2), "relu"),  # (3 × 3 ones run as Winograd)
    (2, 128, (7, 7), 128, 3, 2, (1, 1, 1, 1), "relu"),
    (1, 272, (7, 7), 272, 3, 17, (1, 1, 1, 1), "clip"),  # 16 channels a group
    (1, 192, (14, 14), 192, 3, 3, (1, 1, 1, 1), "relu"),  # 64 a group, 196 pixels
    (2, 64, (5, 9), 40, 3, 1, (1, 1, 1, 1), "none"),  # 45 pixels, panels of 16, 16, 8
    (1, 48, (7, 7), 48, 5, 1, (2, 1, 2, 3), "relu"),  # uneven pads: 7 × 8 outputs
    (2, 256, (7, 7), 256, 3, 8, (1, 1, 1, 1), "residual"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[1:6])) + c[7])
def test_pixel_rows_conv_matches_onnxruntime(case):
    n, cin, size, cout, kernel, group, pads, tail = case
    stages = _run(*_conv_model(n, cin, size, cout, kernel, group, pads, tail))
    assert stages, "the conv did not run with pixels as rows"
    in_registers = tail in ("relu", "clip", "none")
    assert stages[0]["epilogue"] == ("in registers" if in_registers else "a pass of its own")
    if group > 2:  # each task copies the window of the grid its pixels read
        assert stages[0]["input_copy"] == "by the tasks"


STRIDED = [  # (batch, in channels, image, out channels, kernel, groups, pads, tail), stride 2
    (1, 512, (28, 28), 512, 3, 8, (1, 1, 1, 1), "relu"),  # onto 14 × 14: four phase planes
    (1, 160, (15, 13), 64, 3, 4, (1, 0, 1, 2), "clip"),  # 16 a group, 40 in, uneven pads
    (2, 256, (14, 14), 256, 3, 4, (1, 1, 1, 1), "residual"),  # 64 a group, onto 7 × 7
    (1, 96, (11, 11), 96, 5, 4, (2, 2, 2, 2), "none"),  # 5 × 5 of stride 2
]


@pytest.mark.parametrize("case", STRIDED, ids=lambda c: "-".join(map(str, c[1:6])) + c[7])
def test_strided_pixel_rows_conv_matches_onnxruntime(case):
    """Stride-2 grouped convs with enough input channels run with pixels as rows (the cost
    model's `DIRECT_PHASES_OVERHEAD`), reading the stride-phase-split copy in place."""
    n, cin, size, cout, kernel, group, pads, tail = case
    stages = _run(*_conv_model(n, cin, size, cout, kernel, group, pads, tail, stride=2))
    assert stages, "the conv did not run with pixels as rows"
    assert stages[0]["grid"].startswith("4x")


@pytest.mark.parametrize("tail", ["relu", "residual"])
def test_sum_in_several_slices(tail):
    """Slices of the sum 7 long (partial sums kept in the task's tile, the epilogue and the
    transposed store on the last one only), blocks of two tiles each way."""
    schedule = Schedule(vector_bytes=32, gemm_mr=6, gemm_nr=16, gemm_mc=12, gemm_nc=32,
                        gemm_kc=7, gemm_l2_bytes=0)
    stages = _run(*_conv_model(2, 96, (7, 7), 96, 3, 2, (1, 1, 1, 1), tail), schedule)
    assert stages and stages[0]["kc"] == 7


def test_float64_matches_the_reference():
    onnx_model, spec = _conv_model(1, 128, (7, 7), 128, 3, 2, (1, 0, 1, 2), "relu", "float64")
    stages = _run(onnx_model, spec,
                  want=lambda inputs: ReferenceEvaluator(onnx_model).run(None, inputs))
    assert stages


def _window(size: int, kernel: int, stride: int) -> Window:
    out = (size + 2 * (kernel // 2) - kernel) // stride + 1
    return Window((size, size), (out, out), (kernel, kernel), (stride, stride), (1, 1),
                  (kernel // 2,) * 2, (kernel // 2,) * 2)


@pytest.mark.parametrize("size,kernel,stride,channels,channels_in,gemms,wins", [
    (7, 3, 1, 64, 64, 1, True),  # the direct kernel computes 64 columns for 49 pixels
    (14, 3, 1, 64, 64, 1, True),
    (7, 5, 1, 512, 512, 1, True),
    (28, 3, 1, 64, 64, 1, False),  # 840 columns for 784 pixels
    (56, 3, 1, 64, 64, 1, False),
    (28, 3, 2, 64, 64, 8, True),  # the direct kernel's four phase planes, 8 groups
    (14, 3, 2, 64, 64, 17, True),
    (28, 3, 2, 512, 512, 1, False),  # ungrouped: four planes under each tile's broadcasts
    (56, 3, 2, 64, 64, 3, False),
    (112, 3, 2, 64, 64, 4, False),  # onto 56 × 56
    (224, 7, 2, 64, 3, 1, False),  # a stem's short sum over 3 channels
    (14, 1, 2, 512, 256, 1, False),  # a new plane at every step of the sum
    (7, 1, 1, 512, 512, 1, False),
])
def test_cost_model(size, kernel, stride, channels, channels_in, gemms, wins):
    class Ctx:
        schedule = Schedule(vector_bytes=32, gemm_mr=6, gemm_nr=16)
    window = _window(size, kernel, stride)
    assert pixel_rows_wins(Ctx(), window, channels, "float32", channels_in, gemms) == wins


@pytest.mark.parametrize("size,kernel,stride,channels,gemms,wins", [
    (28, 3, 2, 256, 1, True),  # ungrouped onto 14 × 14: the direct kernel's four phase planes
    (14, 3, 2, 512, 1, True),  # onto 7 × 7
    (56, 3, 2, 128, 1, False),  # onto 28 × 28: more than 256 pixels
    (28, 1, 2, 512, 1, False),  # one phase plane: nothing for the direct kernel to pay
    (224, 7, 2, 64, 1, False),  # a stem (3 input channels)
    (28, 3, 2, 64, 8, True),
])
def test_cost_model_avx512(size, kernel, stride, channels, gemms, wins):
    """On AVX-512 ungrouped strided convs onto small images charge the direct kernel its phases
    as grouped ones do (on AVX2 they charge the pixel-rows kernel: `test_cost_model`)."""
    class Ctx:
        schedule = Schedule(vector_bytes=64, gemm_mr=12, gemm_nr=32)
    window = _window(size, kernel, stride)
    channels_in = 3 if kernel == 7 else channels
    assert pixel_rows_wins(Ctx(), window, channels, "float32", channels_in, gemms) == wins
    # with the raw sums in a pass of their own the ungrouped ones stay with the direct kernel
    assert pixel_rows_wins(Ctx(), window, channels, "float32", channels_in, gemms,
                           in_registers=False) == (wins and gemms > 1)


EPILOGUE = TileEpilogue(("max", ("add", ("total",), ("operand", 0)), ("const", 0.0)),
                        ((0, 1),))


@pytest.mark.parametrize("compiler,flags,vector_bytes,mr,nr", [
    ("gcc", ("-mavx2", "-mfma"), 32, 6, 16),
    ("gcc", ("-mavx512f",), 64, 8, 48),
    ("gcc", (), 16, 4, 8),
    ("aarch64-linux-gnu-gcc", ("-march=armv8-a",), 16, 8, 12),
])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_kernels_compile_for_every_isa(compiler, flags, vector_bytes, mr, nr, dtype, tmp_path):
    if shutil.which(compiler) is None:
        pytest.skip(f"no {compiler}")
    lanes = vector_bytes // (4 if dtype == "float32" else 8)
    kernel = MicroKernel(dtype, mr, -(-nr // lanes) * lanes, vector_bytes, epilogue=EPILOGUE,
                         pixel_rows=True)
    path = tmp_path / "ukr.c"
    path.write_text("#include <stdint.h>\n" + vector_extension_source(kernel) + "\n")
    subprocess.run([compiler, *flags, "-O2", "-Wall", "-Wno-unused-function", "-Werror", "-c",
                    str(path), "-o", str(tmp_path / "ukr.o")], check=True, capture_output=True)


def test_kernel_computes_what_it_says(tmp_path):
    """The 6 × 16 AVX2 kernel against numpy: rows read at a + bases[r] + rows[k], partial sums
    kept row-major in the tile, then bias + ReLU and the transposed store on `finish`."""
    fn = avx2_micro_kernel(MicroKernel("float32", 6, 16, 32, epilogue=EPILOGUE, pixel_rows=True),
                           tmp_path)
    rng = np.random.default_rng(4)
    kc, ldc = 9, 23
    a = rng.standard_normal(400).astype(np.float32)
    rows = rng.integers(0, 300, kc).astype(np.int32)
    bases = np.array([0, 1, 2, 40, 41, 77], np.int32)
    b = rng.standard_normal((2 * kc, 16)).astype(np.float32)  # two slices of the sum
    bias = rng.standard_normal(16).astype(np.float32)
    gathered = a[bases[:, None] + rows[None, :]]  # (pixel, k)
    total = gathered @ b[:kc] + gathered @ b[kc:]
    expected = np.maximum(total + bias, 0).T  # (channel, pixel)
    tile = np.zeros(6 * 16, np.float32)
    out = np.zeros((16, ldc), np.float32)
    p = ctypes.c_void_p
    for step in range(2):
        fn(ctypes.c_int64(kc), p(a.ctypes.data), p(b[step * kc:].ctypes.data),
           p(rows.ctypes.data), p(tile.ctypes.data), ctypes.c_int64(ldc), ctypes.c_int(step),
           p(bases.ctypes.data), p(out.ctypes.data), p(bias.ctypes.data), ctypes.c_int(step))
        if step == 0:
            np.testing.assert_allclose(tile.reshape(6, 16), gathered @ b[:kc], rtol=1e-5,
                                       atol=1e-5)
            assert not out.any()
    np.testing.assert_allclose(out[:, :6], expected, rtol=1e-5, atol=1e-5)
    assert not out[:, 6:].any()


@pytest.mark.parametrize("size, tile", [((7, 7), "7x48"), ((8, 8), "8x48")])
def test_pixel_rows_take_the_tile_whose_panels_they_fill(size, tile):
    """AVX-512: a 7 × 7 image's 49 pixels fill seven 7 × 48 tiles, where 8 × 48 ones leave a
    tile of one row (ResNet-50's 3 × 3 convs of 512 channels onto 7 × 7 took 0.98× the time in
    the model); 64 pixels stay in 8 × 48 tiles. Bias and ReLU in registers, against
    onnxruntime."""
    schedule = Schedule(vector_bytes=64, gemm_mr=12, gemm_nr=32)
    stages = _run(*_conv_model(1, 128, size, 96, 3, 2, (1, 1, 1, 1), "relu"), schedule)
    assert stages, "the conv did not run with pixels as rows"
    assert stages[0]["micro_kernel"] == tile


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc")
@pytest.mark.parametrize("tiles, kc, nr", [(7, 256, 48), (3, 40, 48), (2, 17, 32)])
def test_tiles_ask_for_their_shares_of_the_next_slice(tiles, kc, nr, tmp_path):
    """A block's tiles of pixels each ask for a share of the next slice of the weights' panel
    (`packed.spread_ahead`): together every line of it, and none of the slice they read."""
    base = MicroKernel("float32", 7, nr, 64, epilogue=EPILOGUE, pixel_rows=True)
    kernel, ahead = spread_ahead(base, nr, tiles, kc, iconst(kc * nr), iconst(0))
    assert kernel.b_spread and ahead is not None
    body = (f"  float *a = calloc(4096, 4), *b = calloc({3 * kc * nr}, 4);\n"
            f"  float *c = calloc({7 * nr}, 4), *out = calloc({7 * nr}, 4);\n"
            f"  float *bias = calloc({nr}, 4);\n"
            f"  int32_t *rows = calloc({kc}, 4), bases[7] = {{0, 1, 2, 3, 4, 5, 6}};\n")
    body += "\n".join(f"  {kernel.function}({kc}, a, b, rows, c, 7, 0, "
                       f"b + {kc * nr + t * kernel.b_spread * kc}, bases, out, bias, 0);"
                       for t in range(tiles))
    asked = {o // 16 for o in prefetched_offsets(kernel, body, 3 * kc * nr, tmp_path)}
    next_slice = set(range(kc * nr // 16, 2 * kc * nr // 16))
    assert next_slice <= asked and not asked & set(range(kc * nr // 16))
