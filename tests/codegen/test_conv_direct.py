"""Direct convolutions over the padded, stride-phase-split input (kiln.codegen.ops.conv_direct)
against onnxruntime: random kernels (stems with 3 input channels and 7×7 windows included),
strides, dilations, asymmetric pads, groups, batches, and fused prologues and epilogues."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper

from kiln import frontend
from kiln.codegen import generate
from kiln.codegen.backend import backend_for
from kiln.codegen.gemm.blocking import BALANCE_THREADS, balanced, round_up
from kiln.codegen.microkernel import VECTOR_REGISTERS, tile_for
from kiln.codegen.ops.conv_direct import _phase_grid, computed_columns, direct_tile
from kiln.codegen.ops.conv_window import Window
from kiln.codegen.schedule import Schedule
from kiln.target import Target, host_target, target
from tests.codegen.harness import (assert_matches, check_model, model, plan_for,
                                   random_inputs, reference, run_kernels)


@st.composite
def windows(draw, kernels, max_pad, group):
    """A 2-D conv's attributes: square-or-not kernels from `kernels`, strides 1–3, dilations 1–2
    and asymmetric pads up to `max_pad`."""
    return {"kernel_shape": [draw(st.sampled_from(kernels)) for _ in range(2)],
            "strides": [draw(st.integers(1, 3)) for _ in range(2)],
            "dilations": [draw(st.sampled_from([1, 1, 2])) for _ in range(2)],
            "pads": [draw(st.integers(0, max_pad)) for _ in range(4)], "group": group}


@st.composite
def direct_cases(draw):
    """2-D convs with at least 16 output channels per group (the GEMM-sized ones)."""
    group = draw(st.sampled_from([1, 1, 1, 2]))
    cin = group * draw(st.sampled_from([1, 3, 5, 8]))
    cout = group * draw(st.integers(16, 30))
    attrs = draw(windows([1, 2, 3, 3, 5, 7], max_pad=3, group=group))
    kernel, dilations, pads = attrs["kernel_shape"], attrs["dilations"], attrs["pads"]
    spatial = []
    for d in range(2):  # at least one output position per dim
        reach = (kernel[d] - 1) * dilations[d] + 1
        spatial.append(max(draw(st.integers(1, 15)), reach - pads[d] - pads[d + 2]))
    return (draw(st.integers(1, 2)), cin, *spatial), (cout, cin // group, *kernel), attrs


@settings(max_examples=25, deadline=None)
@given(direct_cases(), st.sampled_from(["none", "relu-in", "relu-out", "pad-in"]))
def test_direct_conv(case, fusion):
    onnx_model, inputs = _conv_model(case, fusion, seed=5)
    check_model(onnx_model, inputs, partitioners=("none", "dnnfusion"))


def test_strided_stem_uses_the_direct_kernel():
    """A 7×7 stride-2 stem with 3 input channels runs as the direct kernel, its copy split into
    the four stride phases, and matches onnxruntime."""
    rng = np.random.default_rng(6)
    spec = {"x": ((1, 3, 32, 30), "float32")}
    inits = {"w": rng.standard_normal((24, 3, 7, 7)).astype(np.float32)}
    onnx_model = model([helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[7, 7],
                                         strides=[2, 2], pads=[3, 3, 3, 3])], spec, ["y"], inits)
    check_model(onnx_model, random_inputs(spec), partitioners=("none",))
    assert "direct GEMM grid 4x" in _forms(onnx_model)


def test_a_stem_onto_a_large_output_runs_blocks_of_many_pixels():
    """A 3 × 3 stride-2 stem of 3 input channels (a sum of 27) onto more output than a quarter
    of L2 runs blocks of many more pixels than the schedule's, so that its epilogue stores each
    channel's pixels in long runs; bias and ReLU fused, results matching onnxruntime."""
    onnx_model, spec = _strided_3x3_relu((1, 3, 258, 254), 32, seed=8)
    check_model(onnx_model, random_inputs(spec), partitioners=("dnnfusion",))
    graph = frontend.build(onnx_model, {}, "test")
    stages = [info for kernel in generate(plan_for(graph, "dnnfusion"), host_target())
              for info in kernel.schedule["stages"] if info.get("form") == "direct GEMM"]
    assert stages and stages[0]["nc"] > 2 * Schedule().gemm_nc


@st.composite
def eight_row_cases(draw):
    """2-D convs whose output channels are a multiple of 8 but not of 12, onto images of a few
    hundred pixels: the direct kernel's tile narrows to 8 rows (AVX-512) or 4 (AVX2) and widens
    its panels of pixels to 3 vectors."""
    cin = draw(st.sampled_from([1, 3, 5, 8]))
    cout = 8 * draw(st.sampled_from([2, 4, 5, 7, 8]))
    attrs = draw(windows([3, 3, 5, 7], max_pad=3, group=1))
    kernel, dilations, pads = attrs["kernel_shape"], attrs["dilations"], attrs["pads"]
    spatial = []
    for d in range(2):
        reach = (kernel[d] - 1) * dilations[d] + 1
        spatial.append(max(draw(st.integers(12, 40)), reach - pads[d] - pads[d + 2]))
    return (draw(st.integers(1, 2)), cin, *spatial), (cout, cin, *kernel), attrs


@settings(max_examples=20, deadline=None)
@given(eight_row_cases(), st.sampled_from(["none", "relu-in", "relu-out", "pad-in"]))
def test_direct_conv_with_a_reshaped_tile(case, fusion):
    onnx_model, inputs = _conv_model(case, fusion, seed=7)
    check_model(onnx_model, inputs, partitioners=("none", "dnnfusion"))


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([("avx512f",), ("avx2",), ("neon",)]), st.integers(16, 600),
       windows([1, 3, 5, 7], max_pad=3, group=1), st.integers(1, 120))
def test_direct_tile_does_no_more_work_than_the_targets(isa, channels_out, attrs, size):
    """The direct kernel's tile keeps the target tile's accumulators, needs no more loads per
    step nor more registers, and its whole tiles hold no more products than the target's."""
    base = tile_for(isa, "float32")
    kernel, strides, dilations = attrs["kernel_shape"], attrs["strides"], attrs["dilations"]
    reach = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    spatial = [max(size, r) for r in reach]
    w = Window(tuple(spatial), tuple((n - r) // s + 1 for n, r, s in zip(spatial, reach, strides)),
               tuple(kernel), tuple(strides), tuple(dilations), (0, 0), (0, 0))
    uk = direct_tile(base, w, channels_out)
    vectors, base_vectors = uk.nr // uk.lanes, base.nr // base.lanes
    assert uk.indirect and uk.vector_bytes == base.vector_bytes
    assert uk.mr * vectors == base.mr * base_vectors
    assert uk.mr + vectors <= base.mr + base_vectors
    assert uk.mr * vectors + vectors + 1 <= max(VECTOR_REGISTERS[base.vector_bytes],
                                               base.mr * base_vectors + base_vectors + 1)
    grid, _ = _phase_grid(w, 1, 1)
    pixels = w.out_size[0] * grid.wq
    assert (round_up(channels_out, uk.mr) * computed_columns(pixels, uk.nr, uk.lanes)
            <= round_up(channels_out, base.mr) * computed_columns(pixels, base.nr, base.lanes))


def test_grouped_conv_with_a_partial_last_panel_runs_a_narrower_kernel():
    """Grouped 3 × 3 convs (64 channels per group, RegNet's width) in AVX2's 4 × 24 tiles (64
    rows, none padded, where 6 × 16 would compute 66): a 14 × 26 output's phase grid holds
    14 × 28 = 392 pixels, sixteen panels of 24 and 8 more, which run a kernel of one vector
    (4 × 8), not a seventeenth whole panel; so do stride 2 onto 7 × 7 (grid 7 × 8: 56 pixels)
    and 8 × 26 (8 × 28); 12 × 22 (12 × 24 = 288, twelve panels) needs no narrower kernel.
    All match onnxruntime. (On 14 × 14 and 12 × 12, grids of 224 and 168 pixels for 196 and
    144, the convs run with pixels as rows instead: `test_conv_pixels`.)"""
    rng = np.random.default_rng(15)
    for (height, width), stride, edge in (((14, 26), 1, "4x8"), ((13, 13), 2, "4x8"),
                                          ((8, 26), 1, "4x8"), ((12, 22), 1, None)):
        spec = {"x": ((1, 128, height, width), "float32")}
        inits = {"w": rng.standard_normal((128, 64, 3, 3)).astype(np.float32),
                 "b": rng.standard_normal(128).astype(np.float32)}
        onnx_model = model([
            helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[3, 3],
                             pads=[1, 1, 1, 1], strides=[stride, stride], group=2),
            helper.make_node("Relu", ["c"], ["y"])], spec, ["y"], inits)
        check_model(onnx_model, random_inputs(spec), partitioners=("none", "dnnfusion"))
        graph = frontend.build(onnx_model, {}, "test")
        edges = [info.get("column_edge_kernel")
                 for kernel in generate(plan_for(graph, "none"), target("x86_64"))
                 for info in kernel.schedule.get("stages", []) if info.get("form") == "direct GEMM"]
        assert edges == [edge]


def test_stem_onto_64_channels_runs_with_a_tile_of_whole_channels():
    """A 7 × 7 stride-2 stem onto 64 channels: 12 rows would compute 72 channels, so AVX-512's
    direct tile is 8 × 48 and AVX2's 4 × 24 (both 24 and 12 accumulators, as the targets')."""
    stem = Window((224, 224), (112, 112), (7, 7), (2, 2), (1, 1), (3, 3), (3, 3))
    assert [(uk.mr, uk.nr) for uk in (direct_tile(tile_for(isa, "float32"), stem, 64)
                                      for isa in (("avx512f",), ("avx2",)))] == [(8, 48), (4, 24)]
    rng = np.random.default_rng(8)
    spec = {"x": ((1, 3, 40, 44), "float32")}
    inits = {"w": rng.standard_normal((64, 3, 7, 7)).astype(np.float32)}
    onnx_model = model([helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[7, 7],
                                         strides=[2, 2], pads=[3, 3, 3, 3])], spec, ["y"], inits)
    check_model(onnx_model, random_inputs(spec), partitioners=("none",))
    graph = frontend.build(onnx_model, {}, "test")
    tiles = [info.get("micro_kernel") for kernel in generate(plan_for(graph, "none"),
                                                             target("x86_64"))
             for info in kernel.schedule.get("stages", [])]
    assert "4x24" in tiles


def test_tasks_copy_their_windows_of_the_input():
    """A grouped stride-2 3 × 3 conv (2 images, 2 groups of 64 input channels and 60 output
    ones, too few whole vectors for the pixel-rows kernel; a ReLU read as its prologue) has each
    task copy the window of the input it reads: the grid rows of its pixels and the taps'
    reach, per slice of the sum; on a 56 × 56 image at stride 1 (64 output channels a group)
    the tasks would copy more than twice the input (rows next to each task's 4.5 grid rows),
    so one stage copies it. Both match onnxruntime."""
    rng = np.random.default_rng(16)
    for (height, width), stride, copied_by in (((40, 38), 2, "by the tasks"), ((56, 56), 1, None)):
        cout = 120 if stride == 2 else 128
        spec = {"x": ((2 if stride == 2 else 1, 128, height, width), "float32")}
        inits = {"w": rng.standard_normal((cout, 64, 3, 3)).astype(np.float32),
                 "b": rng.standard_normal(cout).astype(np.float32)}
        onnx_model = model([
            helper.make_node("Relu", ["x"], ["r"]),
            helper.make_node("Conv", ["r", "w", "b"], ["y"], kernel_shape=[3, 3],
                             pads=[1, 0, 2, 1], strides=[stride, stride], group=2)],
            spec, ["y"], inits)
        check_model(onnx_model, random_inputs(spec), partitioners=("none", "dnnfusion"))
        graph = frontend.build(onnx_model, {}, "test")
        copies = [info.get("input_copy")
                  for kernel in generate(plan_for(graph, "none"), target("x86_64"))
                  for info in kernel.schedule.get("stages", [])
                  if info.get("form") == "direct GEMM"]
        assert copies == [copied_by]


@st.composite
def pixel_rows_cases(draw):
    """Convs with few output pixels and many output channels per group (a late stage's 7 × 7
    image), which run as the GEMM with pixels as rows: ragged channel counts, any kernel
    (1 × 1 included, strided or not), stride, dilation, pads, groups and batch."""
    group = draw(st.sampled_from([1, 1, 2]))
    cin = group * draw(st.integers(16, 40))
    cout = group * draw(st.integers(150, 230))
    attrs = draw(windows([1, 2, 3, 3, 5], max_pad=2, group=group))
    kernel, strides = attrs["kernel_shape"], attrs["strides"]
    dilations, pads = attrs["dilations"], attrs["pads"]
    spatial = []
    for d in range(2):
        reach = (kernel[d] - 1) * dilations[d] + 1
        out = draw(st.integers(2, 7))
        spatial.append(max(1, (out - 1) * strides[d] + reach - pads[d] - pads[d + 2]))
    return (draw(st.integers(1, 2)), cin, *spatial), (cout, cin // group, *kernel), attrs


@settings(max_examples=25, deadline=None)
@given(pixel_rows_cases(), st.sampled_from(["none", "relu-in", "relu-out", "pad-in"]))
def test_pixel_rows_conv(case, fusion):
    onnx_model, inputs = _conv_model(case, fusion, seed=9)
    check_model(onnx_model, inputs, partitioners=("none", "dnnfusion"))


def test_late_stage_convs_run_with_pixels_as_rows():
    """A 3 × 3 stride-2 conv and a 1 × 1 conv onto a 7 × 7 image with 256 output channels: 49
    pixels would fill 64 GEMM columns, so with AVX2's 6 × 16 micro-tile they run as the
    transposed GEMM (54 rows), and match onnxruntime on this machine; the same conv onto a
    28 × 28 image keeps pixels as columns. (AVX-512's 12 × 32 tile wastes 11 of 60 rows too:
    there the 3 × 3 conv keeps the direct kernel.)"""
    rng = np.random.default_rng(10)
    spec = {"x": ((1, 32, 14, 14), "float32")}
    inits = {"w3": rng.standard_normal((256, 32, 3, 3)).astype(np.float32),
             "w1": rng.standard_normal((256, 256, 1, 1)).astype(np.float32)}
    onnx_model = model([
        helper.make_node("Conv", ["x", "w3"], ["c"], kernel_shape=[3, 3], strides=[2, 2],
                         pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("Conv", ["r", "w1"], ["y"], kernel_shape=[1, 1])], spec, ["y"], inits)
    check_model(onnx_model, random_inputs(spec), partitioners=("none",))
    assert _forms(onnx_model, target("x86_64")).count("pixels as rows") == 2
    large = model([helper.make_node("Conv", ["x", "w3"], ["y"], kernel_shape=[3, 3],
                                    pads=[1, 1, 1, 1])],
                  {"x": ((1, 32, 28, 28), "float32")}, ["y"], inits)
    assert "pixels as rows" not in _forms(large, target("x86_64"))


@st.composite
def ragged_pointwise_cases(draw):
    """1 × 1 convs onto images whose pixel count is no whole number of GEMM panels (a 14 × 14
    or 7 × 7 stage's), with a long sum: as pixels-as-columns GEMMs their input would be copied
    block by block by every block of output channels, so many run with pixels as rows."""
    cin = draw(st.integers(64, 700))
    cout = draw(st.integers(16, 330))
    size = [draw(st.integers(3, 15)) for _ in range(2)]
    return (draw(st.integers(1, 2)), cin, *size), (cout, cin, 1, 1), {"kernel_shape": [1, 1]}


@settings(max_examples=20, deadline=None)
@given(ragged_pointwise_cases(), st.sampled_from(["none", "relu-in", "relu-out"]))
def test_ragged_pointwise_conv(case, fusion):
    onnx_model, inputs = _conv_model(case, fusion, seed=11)
    check_model(onnx_model, inputs, partitioners=("none", "dnnfusion"))


def test_pointwise_conv_whose_input_every_task_would_copy_runs_with_pixels_as_rows():
    """A 1 × 1 conv 960 → 160 onto a 7 × 7 image: as pixels-as-columns GEMM, 49 pixels are no
    whole panel, so each of its blocks of output channels would copy the 960 × 49 input again;
    it runs with pixels as rows (the input packed once) and matches onnxruntime. With 3136
    pixels (whole panels, read in place), the same conv keeps pixels as columns."""
    rng = np.random.default_rng(12)
    inits = {"w": rng.standard_normal((160, 960, 1, 1)).astype(np.float32)}
    spec = {"x": ((1, 960, 7, 7), "float32")}
    onnx_model = model([helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[1, 1])],
                       spec, ["y"], inits)
    check_model(onnx_model, random_inputs(spec), partitioners=("none",))
    assert "pixels as rows" in _forms(onnx_model)
    large = model([helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[1, 1])],
                  {"x": ((1, 960, 56, 56), "float32")}, ["y"], inits)
    assert "pixels as rows" not in _forms(large)


@st.composite
def winograd_cases(draw):
    """3×3 stride-1 convs with enough 2×2 output tiles and input channels for Winograd (on
    AVX-512, MIN_CHANNELS_BY_VECTOR_BYTES): odd and even sizes, pads of 0–2 on each side,
    batches."""
    cin, cout = draw(st.integers(128, 137)), draw(st.integers(16, 28))
    pads = [draw(st.integers(0, 2)) for _ in range(4)]
    spatial = [draw(st.integers(17, 24)) for _ in range(2)]  # ≥ 64 tiles: two panels of 32
    attrs = {"kernel_shape": [3, 3], "pads": pads}
    return (draw(st.integers(1, 2)), cin, *spatial), (cout, cin, 3, 3), attrs


@settings(max_examples=12, deadline=None)
@given(winograd_cases(), st.sampled_from(["none", "relu-in", "relu-out"]))
def test_winograd_conv(case, fusion):
    onnx_model, inputs = _conv_model(case, fusion, seed=7)
    check_model(onnx_model, inputs, partitioners=("none", "dnnfusion"))
    assert "Winograd" in _forms(onnx_model)


def _l2_for_bands_of_one_panel(cin: int) -> int:
    """An L2 size that holds a Winograd conv's U and V, M blocks of 32-40 tiles, for `cin` input
    channels and at most 36 rows of output channels (`conv_winograd.band_tiles`)."""
    return 16 * 4 * (36 * cin + 40 * (cin + 36))


@settings(max_examples=8, deadline=None)
@given(winograd_cases(), st.sampled_from(["none", "relu-in", "relu-out"]))
def test_winograd_conv_by_bands(case, fusion):
    """With an L2 that holds U and a panel's worth of tiles, each task runs all three stages for
    a band of tiles: bands that cut through tile rows, a partial last band, batches."""
    onnx_model, inputs = _conv_model(case, fusion, seed=5)
    schedule = replace(backend_for(host_target()).schedule,
                       gemm_l2_bytes=_l2_for_bands_of_one_panel(case[0][1]))
    graph = frontend.build(onnx_model, {}, "test")
    want = reference(onnx_model, inputs)
    for name in ("none", "dnnfusion"):
        plan = plan_for(graph, name)
        kernels = generate(plan, host_target(), schedule)
        stages = [info for kernel in kernels for info in kernel.schedule.get("stages", [])]
        assert any(info.get("band_rows") for info in stages), stages
        values = run_kernels(plan, kernels, dict(zip(graph.inputs, inputs.values())))
        assert_matches([values[t] for t in graph.outputs], want, name)


AVX512 = Target("x86_64", "x86_64", ("avx512f", "avx2", "fma"), "gcc", ("-mavx512f", "-mfma"))


def test_winograd_needs_a_panel_of_tiles():
    """A 3 × 3 conv of 128 channels onto 14 × 14 (49 tiles of 2 × 2): Winograd on AVX2 (panels of
    16 tiles) and AVX-512 (panels of 32); onto 7 × 7 (16 tiles) Winograd on AVX2 only, the
    pixel-rows kernel on AVX-512, where half a panel of tiles ran 1.3x as long (ResNet-50's
    7 × 7 × 512 convs on a Zen 4)."""
    rng = np.random.default_rng(8)
    for size, avx512_form in ((14, "Winograd"), (7, "direct, pixels as rows")):
        spec = {"x": ((1, 128, size, size), "float32")}
        inits = {"w": rng.standard_normal((64, 128, 3, 3)).astype(np.float32)}
        onnx_model = model([helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[3, 3],
                                             pads=[1, 1, 1, 1])], spec, ["y"], inits)
        assert "Winograd" in _forms(onnx_model, target("x86_64"))
        forms = _forms(onnx_model, AVX512)
        assert avx512_form in forms and (size == 14 or "Winograd" not in forms)


@pytest.mark.parametrize("channels, avx512_winograd", [(64, True), (32, False)])
def test_winograd_needs_64_input_channels_on_avx512(channels, avx512_winograd):
    """Onto 56 × 56 (784 tiles): Winograd on AVX2 either way; on AVX-512 with 64 channels, and not
    with 32, whose transforms cost more than the products Winograd saves (1.35x the direct
    kernel's time on a Zen 4)."""
    spec = {"x": ((1, channels, 56, 56), "float32")}
    inits = {"w": np.random.default_rng(8).standard_normal((64, channels, 3, 3)
                                                          ).astype(np.float32)}
    onnx_model = model([helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[3, 3],
                                         pads=[1, 1, 1, 1])], spec, ["y"], inits)
    assert "Winograd" in _forms(onnx_model, target("x86_64"))
    forms = _forms(onnx_model, AVX512)
    assert ("Winograd" in forms) == avx512_winograd and (avx512_winograd or "direct" in forms)


def test_strided_ungrouped_conv_by_pixel_rows_on_avx512():
    """An ungrouped 3 × 3 conv of stride 2 onto 10 × 10: the pixel-rows kernel on AVX-512, the
    direct kernel on AVX2; right on this host."""
    onnx_model, spec = _strided_3x3_relu((1, 48, 20, 20), 64, seed=10)
    assert "pixels as rows" in _forms(onnx_model, AVX512)
    assert "pixels as rows" not in _forms(onnx_model, target("x86_64"))
    check_model(onnx_model, random_inputs(spec))


def test_strided_ungrouped_conv_into_tokens_stays_direct_on_avx512():
    """The same conv with its output transposed into tokens (LeViT's stem): the pixel-rows
    kernel would store raw sums for a pass of their own, so the direct kernel runs it."""
    rng = np.random.default_rng(11)
    spec = {"x": ((1, 48, 20, 20), "float32")}
    inits = {"w": rng.standard_normal((64, 48, 3, 3)).astype(np.float32),
             "b": rng.standard_normal(64).astype(np.float32),
             "shape": np.array([1, 64, 100], np.int64)}
    onnx_model = model([helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[3, 3],
                                         strides=[2, 2], pads=[1, 1, 1, 1]),
                        helper.make_node("Reshape", ["c", "shape"], ["r"]),
                        helper.make_node("Transpose", ["r"], ["y"], perm=[0, 2, 1])],
                       spec, ["y"], inits)
    graph = frontend.build(onnx_model, {}, "test")
    kernels = generate(plan_for(graph, "dnnfusion"), AVX512)
    forms = [info.get("form") for k in kernels for info in k.schedule.get("stages", [])]
    assert "direct GEMM" in forms and "direct, pixels as rows" not in forms, forms
    check_model(onnx_model, random_inputs(spec))


def test_patch_embedding_as_transposed_gemm():
    """ViT-Base's patch embedding (16 × 16 of stride 16 onto 14 × 14, 768 channels, the bias in
    the GEMM's tiles): the transposed GEMM, pixels as rows, on AVX2 and AVX-512."""
    rng = np.random.default_rng(12)
    spec = {"x": ((1, 3, 224, 224), "float32")}
    inits = {"w": rng.standard_normal((768, 3, 16, 16)).astype(np.float32),
             "b": rng.standard_normal(768).astype(np.float32)}
    onnx_model = model([helper.make_node("Conv", ["x", "w", "b"], ["y"], kernel_shape=[16, 16],
                                         strides=[16, 16])], spec, ["y"], inits)
    for on in (AVX512, target("x86_64")):
        assert "implicit GEMM, pixels as rows" in _forms(onnx_model, on)
    check_model(onnx_model, random_inputs(spec))


@pytest.mark.parametrize("cin,cout,size,stride,kernel,even", [
    (256, 256, 28, 2, 3, True),  # the direct kernel: 9 tasks alone
    (256, 512, 7, 1, 3, True),  # pixels as rows: 11 alone
    (256, 256, 12, 1, 3, True),  # pixels as rows: 12 alone
    (128, 224, 10, 1, 3, False),  # 10 tasks of 2.6M products; balanced, each under 2M
])
def test_direct_tasks_split_evenly_over_threads(cin, cout, size, stride, kernel, even):
    """The direct kernels' tasks split evenly over 2 and 4 threads (as the packed GEMM's)
    when each keeps enough products and that keeps the tasks' own copies of the input."""
    rng = np.random.default_rng(9)
    spec = {"x": ((1, cin, size, size), "float32")}
    inits = {"w": rng.standard_normal((cout, cin, kernel, kernel)).astype(np.float32)}
    onnx_model = model([helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[kernel] * 2,
                                         strides=[stride] * 2, pads=[kernel // 2] * 4)],
                       spec, ["y"], inits)
    graph = frontend.build(onnx_model, {}, "test")
    stages = [info for k in generate(plan_for(graph, "none"), AVX512)
              for info in k.schedule.get("stages", []) if "tasks" in info]
    assert len(stages) == 1 and balanced(stages[0]["tasks"], BALANCE_THREADS) == even, stages
    check_model(onnx_model, random_inputs(spec), partitioners=("none",))


@st.composite
def depthwise_plane_cases(draw):
    """Depthwise convs up to 7×7 (ConvNeXt's), any stride, dilation, pads and multiplier."""
    channels, multiplier = draw(st.integers(1, 4)), draw(st.sampled_from([1, 1, 2]))
    attrs = draw(windows([1, 3, 5, 7], max_pad=3, group=channels))
    kernel, dilations, pads = attrs["kernel_shape"], attrs["dilations"], attrs["pads"]
    spatial = []
    for d in range(2):
        reach = (kernel[d] - 1) * dilations[d] + 1
        spatial.append(max(draw(st.integers(1, 20)), reach - pads[d] - pads[d + 2]))
    return ((draw(st.integers(1, 2)), channels, *spatial), (channels * multiplier, 1, *kernel),
            attrs)


@settings(max_examples=20, deadline=None)
@given(depthwise_plane_cases(), st.sampled_from(["none", "relu-in", "relu-out"]))
def test_depthwise_planes(case, fusion):
    attrs = case[2]
    onnx_model, inputs = _conv_model(case, fusion, seed=8)
    check_model(onnx_model, inputs, partitioners=("none", "dnnfusion"))
    if attrs["strides"] == [1, 1] and attrs["group"] > 1:  # one channel, 1×1: a matrix product
        assert "depthwise" in _forms(onnx_model)  # over planes, or in place (rows of a few)


def test_narrow_depthwise_planes_with_a_silu():
    """A 5 × 5 depthwise conv onto 7 × 7 planes with a fused SiLU (EfficientNet's last stage):
    rows narrower than two vectors, so the sums are packed densely and the epilogue runs over
    the whole plane; it matches onnxruntime."""
    onnx_model, spec = depthwise_5x5_silu((2, 6, 7, 7), seed=11)
    check_model(onnx_model, random_inputs(spec), partitioners=("none", "dnnfusion"))
    assert [s.get("form") for s in _fused_stages(onnx_model)] == ["depthwise planes"]


def depthwise_5x5_silu(shape: tuple[int, ...], seed: int):
    """A 5 × 5 depthwise conv (pads 2) with a bias, then a SiLU, over an input of `shape`: the
    model and its input spec."""
    rng = np.random.default_rng(seed)
    channels = shape[1]
    spec = {"x": (shape, "float32")}
    inits = {"w": rng.standard_normal((channels, 1, 5, 5)).astype(np.float32),
             "b": rng.standard_normal(channels).astype(np.float32)}
    onnx_model = model([
        helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[5, 5], pads=[2, 2, 2, 2],
                         group=channels),
        helper.make_node("Sigmoid", ["c"], ["s"]),
        helper.make_node("Mul", ["c", "s"], ["y"])], spec, ["y"], inits)
    return onnx_model, spec


@pytest.mark.parametrize("on,form", [(None, "depthwise"), (target("x86_64"), "depthwise planes")],
                         ids=["host", "avx2"])
def test_depthwise_rows_under_half_a_vector_run_in_place(on, form):
    """A 3 × 3 depthwise conv onto 7 × 7 planes under a ReLU6 on 5 channels (not a vector of
    them, `test_conv_channels`): rows under half an AVX-512 vector run in place, with no padded plane; AVX2's 8 lanes keep the
    planes. A SiLU keeps them everywhere (`test_narrow_depthwise_planes_with_a_silu`). It
    matches onnxruntime."""
    if on is None and host_target().vector_bytes < 64:
        pytest.skip("needs an AVX-512 host")
    onnx_model, spec = _depthwise_relu6((2, 5, 7, 7), 1, seed=16)
    check_model(onnx_model, random_inputs(spec), partitioners=("none", "dnnfusion"))
    stages = _fused_stages(onnx_model, on)
    assert [s.get("form") for s in stages] == [form], stages


def test_strided_depthwise_after_a_pad_reads_planes():
    """EfficientNet's stride-2 depthwise convs read an explicitly padded input, so no output
    touches the padding; the padded planes (contiguous reads per stride phase, one vector loop
    per plane) still beat reading that input in place at the stride. Output rows of 18 are over
    two vectors with a remainder: with a SiLU the sums are packed densely for the epilogue. It
    matches onnxruntime."""
    rng = np.random.default_rng(12)
    spec = {"x": ((2, 6, 37, 37), "float32")}
    inits = {"w": rng.standard_normal((6, 1, 5, 5)).astype(np.float32),
             "b": rng.standard_normal(6).astype(np.float32),
             "pads": np.array([0, 0, 1, 1, 0, 0, 2, 2], np.int64)}
    onnx_model = model([
        helper.make_node("Pad", ["x", "pads"], ["xp"]),
        helper.make_node("Conv", ["xp", "w", "b"], ["c"], kernel_shape=[5, 5], strides=[2, 2],
                         group=6),
        helper.make_node("Sigmoid", ["c"], ["s"]),
        helper.make_node("Mul", ["c", "s"], ["y"])], spec, ["y"], inits)
    check_model(onnx_model, random_inputs(spec), partitioners=("none", "dnnfusion"))
    assert "depthwise planes" in _forms(onnx_model)


def test_wide_depthwise_rows_through_a_clip():
    """Output rows of whole vectors (32 wide, AVX2's and AVX-512's) under a ReLU6: each row's
    window sums go through the epilogue to the output with no plane of sums; stride 1 and 2,
    with a residual Add after the Clip. It matches onnxruntime."""
    rng = np.random.default_rng(14)
    spec = {"x": ((1, 4, 12, 32), "float32"), "r": ((1, 4, 12, 32), "float32")}
    inits = {"w": rng.standard_normal((4, 1, 3, 3)).astype(np.float32),
             "b": rng.standard_normal(4).astype(np.float32),
             "lo": np.array(0, np.float32), "hi": np.array(6, np.float32)}
    onnx_model = model([
        helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1],
                         group=4),
        helper.make_node("Clip", ["c", "lo", "hi"], ["k"]),
        helper.make_node("Add", ["k", "r"], ["y"])], spec, ["y"], inits)
    check_model(onnx_model, random_inputs(spec), partitioners=("none", "dnnfusion"))
    assert "depthwise planes" in _forms(onnx_model)
    strided = {"x": ((1, 4, 12, 64), "float32")}
    onnx_model = model([
        helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1],
                         strides=[2, 2], group=4),
        helper.make_node("Clip", ["c", "lo", "hi"], ["y"])], strided, ["y"], inits)
    check_model(onnx_model, random_inputs(strided), partitioners=("none", "dnnfusion"))


@pytest.mark.parametrize("on", [None, target("x86_64")], ids=["host", "avx2"])
def test_depthwise_rows_of_partial_vectors_store_their_sums_through_the_epilogue(on):
    """Output rows of 36 under a ReLU6 (past two vectors of AVX-512 and of AVX2, not a whole
    number of either, as MobileNetV2's rows of 56 on AVX-512) skip the plane of sums too: each
    row's window sums go through the epilogue to the output. Stride 1 and 2; it matches
    onnxruntime."""
    for stride, width in [(1, 36), (2, 72)]:
        onnx_model, spec = _depthwise_relu6((1, 3, 5, width), stride, seed=15)
        check_model(onnx_model, random_inputs(spec), partitioners=("none", "dnnfusion"))
        stages = _fused_stages(onnx_model, on)
        assert [s.get("window_sums") for s in stages] == ["to the output"], stages


def test_depthwise_plane_too_large_for_the_stack():
    """A plane whose padded copy would not fit the stack is read in place, its interior and
    border outputs apart; it matches onnxruntime."""
    onnx_model, spec = _depthwise_relu6((1, 2, 260, 260), 2, seed=13)
    check_model(onnx_model, random_inputs(spec), partitioners=("none",))
    forms = _forms(onnx_model)
    assert "depthwise" in forms and "depthwise planes" not in forms


def _depthwise_relu6(shape: tuple[int, ...], stride: int, seed: int):
    """A 3 × 3 depthwise conv (pads 1, `stride`) with a bias, then a ReLU6, over an input of
    `shape`: the model and its input spec."""
    rng = np.random.default_rng(seed)
    channels = shape[1]
    spec = {"x": (shape, "float32")}
    inits = {"w": rng.standard_normal((channels, 1, 3, 3)).astype(np.float32),
             "b": rng.standard_normal(channels).astype(np.float32),
             "lo": np.array(0, np.float32), "hi": np.array(6, np.float32)}
    onnx_model = model([
        helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1],
                         strides=[stride, stride], group=channels),
        helper.make_node("Clip", ["c", "lo", "hi"], ["y"])], spec, ["y"], inits)
    return onnx_model, spec


def _conv_model(case, fusion: str, seed: int):
    """Conv with bias over `case` (x shape, w shape, attributes), with `fusion`: a Relu read by
    the conv (relu-in, a prologue the padded copy evaluates once per element), a zero Pad folded
    into its padding (pad-in), or a Relu after it (relu-out). Returns the model and its inputs."""
    x_shape, w_shape, attrs = case
    rng = np.random.default_rng(seed)
    inits = {"w": rng.standard_normal(w_shape).astype(np.float32),
             "b": rng.standard_normal(w_shape[0]).astype(np.float32)}
    spec = {"x": (x_shape, "float32")}
    nodes, conv_in = [], "x"
    if fusion == "relu-in":
        nodes.append(helper.make_node("Relu", ["x"], ["xr"]))
        conv_in = "xr"
    elif fusion == "pad-in":
        inits["pads"] = np.array([0, 0, 1, 2, 0, 0, 2, 1], np.int64)
        nodes.append(helper.make_node("Pad", ["x", "pads"], ["xp"]))
        conv_in = "xp"
    nodes.append(helper.make_node("Conv", [conv_in, "w", "b"], ["c"], **attrs))
    nodes.append(helper.make_node("Relu" if fusion == "relu-out" else "Identity", ["c"], ["y"]))
    return model(nodes, spec, ["y"], inits), random_inputs(spec)


def _strided_3x3_relu(x_shape: tuple[int, ...], cout: int, seed: int):
    """A 3 × 3 conv of stride 2 (pads 1) with a bias, then a ReLU: (model, input spec)."""
    rng = np.random.default_rng(seed)
    spec = {"x": (x_shape, "float32")}
    inits = {"w": rng.standard_normal((cout, x_shape[1], 3, 3)).astype(np.float32),
             "b": rng.standard_normal(cout).astype(np.float32)}
    return model([helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[3, 3],
                                   strides=[2, 2], pads=[1, 1, 1, 1]),
                  helper.make_node("Relu", ["c"], ["y"])], spec, ["y"], inits), spec


def _fused_stages(onnx_model, on: Target | None = None) -> list[dict]:
    """What each stage of `onnx_model`'s kernels (partitioner dnnfusion) records, for target `on`
    (default: this machine)."""
    graph = frontend.build(onnx_model, {}, "test")
    return [info for kernel in generate(plan_for(graph, "dnnfusion"), on or host_target())
            for info in kernel.schedule.get("stages", [])]


def _forms(onnx_model, on: Target | None = None) -> str:
    """The kernel forms the stages of `onnx_model`'s kernels (partitioner none) were built as,
    for target `on` (default: this machine)."""
    graph = frontend.build(onnx_model, {}, "test")
    kernels = generate(plan_for(graph, "none"), on or host_target())
    return " ".join(str(info.get("form")) + (f" grid {info['grid']}" if info.get("grid") else "")
                    + (f" ({info['conv']})" if info.get("conv") else "")
                    for kernel in kernels for info in kernel.schedule.get("stages", []))


@pytest.mark.parametrize("avx512", [False, True])
@pytest.mark.parametrize("stride, pads", [(2, (0, 0, 0, 0)), (1, (1, 0, 1, 0)), (3, (1, 1, 0, 0))])
def test_strided_or_padded_pointwise_conv_runs_as_the_implicit_gemm(avx512, stride, pads):
    """A 1 × 1 conv of stride 2 (a residual block's shortcut) onto pixels that fill its panels,
    or a padded one: the implicit GEMM packs the strided gather of the input the direct kernel
    would copy anyway, and runs the packed kernel's tiles with the epilogue in registers
    (ResNet-50's from 56 × 56 took 0.83× the time). Against onnxruntime."""
    rng = np.random.default_rng(stride)
    spec = {"x": ((1, 64, 48, 48), "float32")}
    inits = {"w": rng.standard_normal((128, 64, 1, 1)).astype(np.float32),
             "b": rng.standard_normal(128).astype(np.float32)}
    onnx_model = model([
        helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[1, 1],
                         strides=[stride, stride], pads=list(pads)),
        helper.make_node("Relu", ["c"], ["y"])], spec, ["y"], inits)
    check_model(onnx_model, random_inputs(spec), partitioners=("none", "dnnfusion"))
    assert "(implicit GEMM)" in _forms(onnx_model, AVX512 if avx512 else target("x86_64"))
