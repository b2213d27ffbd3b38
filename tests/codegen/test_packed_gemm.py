"""The packed GEMM path (micro-kernels over packed operands) against onnxruntime: every micro-kernel
shape the ISAs use, cache blocks small enough that every axis has several blocks and a ragged
last one, constant and computed B operands, batches with broadcasting, convolutions."""
from __future__ import annotations

import re
import shutil
import subprocess

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper

from kiln import frontend
from kiln.codegen import generate
from kiln.codegen.backend import backend_for
from kiln.codegen.gemm.blocking import BALANCE_THREADS, IDLE_SHARE, blocking, idle_share
from kiln.codegen.microkernel import (
    ISA_TILES,
    PREFETCH_STEPS,
    MicroKernel,
    fits_registers,
    padding_tiles,
    pixel_rows_source,
    tile_for,
    vector_extension_source,
)
from kiln.codegen.schedule import Schedule
from kiln.target import host_target
from tests.codegen.harness import (
    prefetched_offsets,
    assert_matches,
    check_model,
    model,
    plan_for,
    random_inputs,
    reference,
    run_kernels,
)

# (vector bytes, mr, nr): AVX-512, AVX2, NEON and the SSE-width fallback
TILES = [(vb, mr, nr) for _, vb, mr, nr in ISA_TILES] + [(16, 4, 8)]


def run_with(m, spec, schedule: Schedule):
    inputs = random_inputs(spec)
    graph = frontend.build(m, {}, "t")
    plan = plan_for(graph, "dnnfusion")
    kernels = generate(plan, host_target(), schedule)
    values = run_kernels(plan, kernels, dict(zip(graph.inputs, inputs.values())))
    assert_matches([values[t] for t in graph.outputs], reference(m, inputs), str(schedule))
    return kernels


def forms(kernels) -> set[str]:
    return {s.get("form") for k in kernels for s in k.schedule["stages"]}


def small_blocks(tile, **extra) -> Schedule:
    vb, mr, nr = tile
    return Schedule(vector_bytes=vb, gemm_mr=mr, gemm_nr=nr, gemm_mc=mr, gemm_nc=nr, gemm_kc=5,
                    gemm_l2_bytes=0, **extra)


@pytest.mark.parametrize("tile", TILES, ids=lambda t: f"{t[1]}x{t[2]}v{t[0]}")
def test_matmul_constant_weights_every_micro_kernel(tile):
    spec = {"a": ((2, 27, 13), "float32")}
    w = np.random.default_rng(1).standard_normal((13, 37)).astype(np.float32)
    bias = np.random.default_rng(2).standard_normal(37).astype(np.float32)
    m = model([helper.make_node("MatMul", ["a", "w"], ["h"]),
               helper.make_node("Add", ["h", "bias"], ["y"])], spec, ["y"], {"w": w, "bias": bias})
    kernels = run_with(m, spec, small_blocks(tile))
    assert "packed" in forms(kernels)
    stage = next(s for k in kernels for s in k.schedule["stages"] if s.get("form") == "packed")
    assert stage["b_operand"] == "pre-packed constant"
    assert stage["micro_kernel"] == f"{tile[1]}x{tile[2]}"


@settings(max_examples=8, deadline=None)
@given(batch=st.sampled_from([(), (3,), (2, 1)]), m=st.integers(4, 30), k=st.integers(1, 20),
       n=st.integers(8, 40), tile=st.sampled_from(TILES))
def test_batched_matmul_of_activations(batch, m, k, n, tile):
    """B computed at run time (packed into scratch: its prologue evaluated once), broadcast over
    A's batch."""
    spec = {"a": ((*batch, m, k), "float32"), "b": ((k, n), "float32")}
    nodes = [helper.make_node("Relu", ["b"], ["rb"]), helper.make_node("MatMul", ["a", "rb"], ["y"])]
    kernels = run_with(model(nodes, spec, ["y"]), spec, small_blocks(tile))
    stage = next(s for k in kernels for s in k.schedule["stages"] if s.get("form") == "packed")
    assert stage["b_operand"] == "packed in scratch rows"


@pytest.mark.parametrize("tile", TILES, ids=lambda t: f"{t[1]}x{t[2]}v{t[0]}")
@pytest.mark.parametrize("n", [48, 50])
def test_activation_operand_read_in_place_or_copied_to_rows(tile, n):
    """B rows that are whole vectors are read where they are (a last, partial panel runs a kernel
    of just its vectors); others are copied block by block by the GEMM's tasks, past N padded to
    whole panels."""
    spec = {"a": ((2, 13, 10), "float32"), "b": ((2, 10, n), "float32")}
    kernels = run_with(model([helper.make_node("MatMul", ["a", "b"], ["y"])], spec, ["y"]), spec,
                       small_blocks(tile))
    stage = next(s for k in kernels for s in k.schedule["stages"] if s.get("form") == "packed")
    want = "read in place" if n % (tile[0] // 4) == 0 else "copied by the tasks"
    assert stage["b_operand"] == want


def _gathers(kernels, tmp_path) -> int:
    """Gather instructions in the kernels' code as GCC builds it for an AVX-512 Xeon."""
    path = tmp_path / "kernel.c"
    path.write_text("\n".join(k.source for k in kernels))
    flags = ("-O3", "-fopenmp-simd", "-march=skylake-avx512", "-S", "-o", "-")
    return subprocess.run(["gcc", *flags, str(path)], check=True, capture_output=True,
                          text=True).stdout.count("gather")


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc")
@pytest.mark.parametrize("n", [40, 50])
def test_a_task_copies_its_block_of_b_with_vector_loads(n, tmp_path):
    """A task's copy of its block of a B contiguous along its rows reads each row's columns as one
    run: a bounds clamp on every column index made GCC gather them (a 14 × 14 image's 1 × 1 conv
    of 96 → 576 channels took 1.4× the time). The last block's columns past N are zeros."""
    spec = {"a": ((2, 13, 10), "float32"), "b": ((2, 10, n), "float32")}
    tile = TILES[0]
    kernels = run_with(model([helper.make_node("MatMul", ["a", "b"], ["y"])], spec, ["y"]), spec,
                       replace(small_blocks(tile), gemm_nc=2 * tile[2]))
    stage = next(s for k in kernels for s in k.schedule["stages"] if s.get("form") == "packed")
    assert stage["b_operand"] == "copied by the tasks"
    assert _gathers(kernels, tmp_path) == 0


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc")
def test_the_last_partial_panel_is_packed_with_vector_loads(tmp_path):
    """A 14 × 14 image's 1 × 1 conv with its pixels as rows packs them in panels of 12; the last,
    partial one copies its pixels as one run, then zeros (a clamp made GCC gather them)."""
    spec = {"x": ((1, 576, 14, 14), "float32")}
    weights = {"w": np.random.default_rng(0).standard_normal((96, 576, 1, 1)).astype(np.float32)}
    m = model([helper.make_node("Conv", ["x", "w"], ["y"])], spec, ["y"], weights)
    kernels = run_with(m, spec, Schedule(vector_bytes=64, gemm_mr=12, gemm_nr=32))
    stages = [s["stage"] for k in kernels for s in k.schedule["stages"]]
    assert any("in panels" in c for c in stages), stages
    assert _gathers(kernels, tmp_path) == 0


@pytest.mark.parametrize("tile", TILES, ids=lambda t: f"{t[1]}x{t[2]}v{t[0]}")
@pytest.mark.parametrize("m", [4, 13, 24])
def test_activation_a_read_in_place_with_a_partial_last_panel(tile, m):
    """A row-major run-time A is read where it is by a row-reading micro-kernel, its last partial
    panel (or a whole A shorter than a panel) by a kernel of that panel's rows, over several
    blocks of the sum and a batch; an A with arithmetic before the product is evaluated once, into
    rows in scratch read in place the same way."""
    spec = {"a": ((3, m, 11), "float32"), "w": ((11, 21), "float32")}
    w = np.random.default_rng(4).standard_normal((11, 21)).astype(np.float32)
    plain = model([helper.make_node("MatMul", ["a", "w"], ["y"])], {"a": spec["a"]}, ["y"],
                  {"w": w})
    kernels = run_with(plain, {"a": spec["a"]}, small_blocks(tile))
    stage = next(s for k in kernels for s in k.schedule["stages"] if s.get("form") == "packed")
    assert stage["a_operand"] == "read in place"
    edge_rows = 3 * m % tile[1]  # the batch's rows are one product of 3·m rows
    assert stage.get("row_edge_kernel") == (f"{edge_rows}x{tile[2]}" if edge_rows else None)
    nodes = [helper.make_node("Relu", ["a"], ["ra"]), helper.make_node("MatMul", ["ra", "w"], ["y"])]
    kernels = run_with(model(nodes, {"a": spec["a"]}, ["y"], {"w": w}), {"a": spec["a"]},
                       small_blocks(tile))
    stage = next(s for k in kernels for s in k.schedule["stages"] if s.get("form") == "packed")
    assert stage["a_operand"] == "rows in scratch, read in place"
    assert stage.get("row_edge_kernel") == (f"{edge_rows}x{tile[2]}" if edge_rows else None)


@pytest.mark.parametrize("tile", TILES, ids=lambda t: f"{t[1]}x{t[2]}v{t[0]}")
def test_a_through_a_prologue_in_rows_shared_and_broadcast(tile):
    """A through arithmetic (Add of a bias, GELU) goes to row-major rows in scratch, once, the
    second product of the same A reading the first one's rows; an A broadcast over the batch of
    a run-time B is indexed by its own batch; a transposed A (loads contiguous along the rows) is
    still packed in panels, whose loads and stores are contiguous then."""
    rng = np.random.default_rng(5)
    w1 = rng.standard_normal((11, 21)).astype(np.float32)
    w2 = rng.standard_normal((11, 40)).astype(np.float32)
    bias = rng.standard_normal((11,)).astype(np.float32)
    spec = {"a": ((2, 13, 11), "float32")}
    nodes = [helper.make_node("Add", ["a", "bias"], ["ab"]),
             helper.make_node("Gelu", ["ab"], ["g"]),
             helper.make_node("MatMul", ["g", "w1"], ["y1"]),
             helper.make_node("MatMul", ["g", "w2"], ["y2"])]
    kernels = run_with(model(nodes, spec, ["y1", "y2"], {"w1": w1, "w2": w2, "bias": bias},
                             opset=20), spec, small_blocks(tile))
    operands = [s.get("a_operand") for k in kernels for s in k.schedule["stages"]
                if s.get("form") == "packed"]
    assert operands == ["rows in scratch, read in place", "rows in scratch by an earlier product"]
    # a broadcast A (one matrix) times a batch of run-time B
    spec = {"a": ((13, 11), "float32"), "b": ((3, 11, 40), "float32")}
    nodes = [helper.make_node("Relu", ["a"], ["ra"]),
             helper.make_node("MatMul", ["ra", "b"], ["y"])]
    kernels = run_with(model(nodes, spec, ["y"]), spec, small_blocks(tile))
    stage = next(s for k in kernels for s in k.schedule["stages"] if s.get("form") == "packed")
    assert stage["a_operand"] == "rows in scratch, read in place"
    # transposed A, plain or through a prologue with a bias: contiguous along its rows, packed
    # in panels with contiguous loads and stores
    spec = {"a": ((11, 13), "float32")}
    for prologue in ([], [helper.make_node("Add", ["at", "bias"], ["at2"])]):
        nodes = [helper.make_node("Transpose", ["a"], ["at"], perm=[1, 0]), *prologue,
                 helper.make_node("MatMul", ["at2" if prologue else "at", "w1"], ["y"])]
        kernels = run_with(model(nodes, spec, ["y"], {"w1": w1, "bias": bias}), spec,
                           small_blocks(tile))
        stage = next(s for k in kernels for s in k.schedule["stages"] if s.get("form") == "packed")
        assert stage["a_operand"] == "packed in scratch"


@pytest.mark.parametrize("k,tile", [(1024, "6x64"), (1032, "12x32"), (768, "12x32")])
def test_rows_of_a_that_share_l1_sets_run_a_tile_of_half_the_rows(k, tile):
    """AVX-512's 12 rows of A read in place 4 KiB apart fall into one L1 set (more lines than its
    8 ways): the product runs 6×64 tiles, the same accumulators; rows 4128 or 3072 bytes apart
    keep 12×32."""
    spec = {"a": ((30, k), "float32")}
    rng = np.random.default_rng(k)
    w, bias = (rng.standard_normal((k, 70)).astype(np.float32),
               rng.standard_normal(70).astype(np.float32))
    nodes = [helper.make_node("MatMul", ["a", "w"], ["h"]),
             helper.make_node("Add", ["h", "bias"], ["y"])]
    onnx_model = model(nodes, spec, ["y"], {"w": w, "bias": bias})
    kernels = run_with(onnx_model, spec, Schedule(vector_bytes=64, gemm_mr=12, gemm_nr=32))
    stage = next(s for k in kernels for s in k.schedule["stages"] if s.get("form") == "packed")
    assert stage["a_operand"] == "read in place" and stage["micro_kernel"] == tile


@pytest.mark.parametrize("tile", TILES, ids=lambda t: f"{t[1]}x{t[2]}v{t[0]}")
def test_slice_of_the_sum_grows_while_the_blocks_fit_in_cache(tile):
    """The slice of the sum grows past the schedule's to an even split of K while a task's blocks
    of A and B fit in `gemm_l2_bytes` (100 of the sum here: three passes over 300); 0 keeps the
    schedule's (an even split of 32: ten passes of 30)."""
    vb, mr, nr = tile
    spec = {"a": ((20, 300), "float32")}
    rng = np.random.default_rng(12)
    w, bias = (rng.standard_normal((300, 40)).astype(np.float32),
               rng.standard_normal(40).astype(np.float32))
    nodes = [helper.make_node("MatMul", ["a", "w"], ["h"]),
             helper.make_node("Add", ["h", "bias"], ["y"])]
    for cache, kc in (((mr + nr) * 4 * 100, 100), (0, 30)):
        schedule = Schedule(vector_bytes=vb, gemm_mr=mr, gemm_nr=nr, gemm_mc=mr, gemm_nc=nr,
                            gemm_kc=32, gemm_l2_bytes=cache)
        kernels = run_with(model(nodes, spec, ["y"], {"w": w, "bias": bias}), spec, schedule)
        stage = next(s for k in kernels for s in k.schedule["stages"] if s.get("form") == "packed")
        assert (stage["mc"], stage["nc"], stage["kc"]) == (mr, nr, kc)


@settings(max_examples=20, deadline=None)
@given(m=st.integers(4, 40), k=st.integers(1, 24), n=st.integers(8, 80),
       epilogue=st.sampled_from(["none", "bias"]), tile=st.sampled_from(TILES))
def test_partial_panels_by_kernels_of_their_rows_and_columns(m, k, n, epilogue, tile):
    """M or N not a multiple of the micro-kernel's: the last panel's rows, read in place by a
    kernel of just those rows, and the last panel's columns by a kernel of just the vectors
    they need (both at the corner), through the epilogue or not, over several blocks of the
    sum."""
    spec = {"a": ((m, k), "float32")}
    rng = np.random.default_rng(m * 41 + k * 7 + n)
    w, bias = (rng.standard_normal((k, n)).astype(np.float32),
               rng.standard_normal(n).astype(np.float32))
    nodes = [helper.make_node("MatMul", ["a", "w"], ["y" if epilogue == "none" else "h"])]
    if epilogue == "bias":
        nodes.append(helper.make_node("Add", ["h", "bias"], ["y"]))
    kernels = run_with(model(nodes, spec, ["y"], {"w": w, "bias": bias}), spec,
                       small_blocks(tile))
    stage = next(s for k in kernels for s in k.schedule["stages"] if s.get("form") == "packed")
    assert stage["a_operand"] == "read in place"
    vb, mr, nr = tile
    assert stage.get("row_edge_kernel") == (f"{m % mr}x{nr}" if m % mr else None)
    lanes = vb // 4
    edge_cols = -(-(n % nr) // lanes) * lanes % nr
    assert stage.get("column_edge_kernel") == (f"{mr}x{edge_cols}" if edge_cols else None)


@pytest.mark.parametrize("tile", TILES, ids=lambda t: f"{t[1]}x{t[2]}v{t[0]}")
def test_weights_times_a_batch_of_rows_is_one_product(tile):
    """A batch of row-major A times one weight matrix runs as one product of batch × M rows (a
    micro-tile spans two batches), through the fused epilogue; a batched B keeps the batches."""
    spec = {"a": ((2, 5, 7, 9), "float32")}
    rng = np.random.default_rng(7)
    w, bias = (rng.standard_normal((9, 19)).astype(np.float32),
               rng.standard_normal(19).astype(np.float32))
    m = model([helper.make_node("MatMul", ["a", "w"], ["h"]),
               helper.make_node("Add", ["h", "bias"], ["y"])], spec, ["y"], {"w": w, "bias": bias})
    kernels = run_with(m, spec, small_blocks(tile))
    stage = next(s for k in kernels for s in k.schedule["stages"] if s.get("form") == "packed")
    assert stage["product_rows"] == 70
    spec = {"a": ((5, 7, 9), "float32"), "b": ((5, 9, 19), "float32")}
    kernels = run_with(model([helper.make_node("MatMul", ["a", "b"], ["y"])], spec, ["y"]), spec,
                       small_blocks(tile))
    stage = next(s for k in kernels for s in k.schedule["stages"] if s.get("form") == "packed")
    assert stage["product_rows"] == 7


@pytest.mark.parametrize("tile", TILES, ids=lambda t: f"{t[1]}x{t[2]}v{t[0]}")
def test_whole_tiles_of_a_plain_product_are_stored_by_the_micro_kernel(tile):
    """Without an epilogue, or with one the micro-kernel applies in registers (a bias), whole
    micro-tiles accumulate in the output itself over the slices of the sum (the ragged ones still
    go through a local tile); with one that reads another tensor (a residual) every tile does."""
    spec = {"a": ((2, 17, 13), "float32"), "r": ((2, 17, 37), "float32")}
    w = np.random.default_rng(8).standard_normal((13, 37)).astype(np.float32)
    bias = np.random.default_rng(9).standard_normal(37).astype(np.float32)

    def packed_stage(nodes, inits):
        kernels = run_with(model(nodes, spec, ["y"], inits), spec, small_blocks(tile))
        return next(s for k in kernels for s in k.schedule["stages"] if s.get("form") == "packed")

    plain = packed_stage([helper.make_node("MatMul", ["a", "w"], ["y"])], {"w": w})
    assert plain["whole_tiles"] == "stored by the micro-kernel"
    biased = packed_stage([helper.make_node("MatMul", ["a", "w"], ["h"]),
                           helper.make_node("Add", ["h", "bias"], ["y"])], {"w": w, "bias": bias})
    assert (biased["whole_tiles"], biased["epilogue"]) == ("stored by the micro-kernel",
                                                           "in registers")
    residual = packed_stage([helper.make_node("MatMul", ["a", "w"], ["h"]),
                             helper.make_node("Add", ["h", "r"], ["y"])], {"w": w})
    assert "whole_tiles" not in residual


@settings(max_examples=6, deadline=None)
@given(batch=st.integers(1, 3), m=st.integers(4, 30), k=st.integers(1, 20), n=st.integers(8, 60),
       tile=st.sampled_from(TILES))
def test_a_fused_epilogue_runs_once_per_block(batch, m, k, n, tile):
    """A fused epilogue (a bias, a residual added, a ReLU) runs over each finished cache block
    along its rows, not per micro-tile: over ragged blocks, several slices of the sum and a
    batch folded into the rows. (A product of one slice into an output larger than L2 runs row
    panel by row panel, its residual read per tile in registers: the test below.)"""
    spec = {"a": ((batch, m, k), "float32"), "r": ((batch, m, n), "float32")}
    rng = np.random.default_rng(batch * 1000 + m * 41 + k * 7 + n)
    w, bias = (rng.standard_normal((k, n)).astype(np.float32),
               rng.standard_normal(n).astype(np.float32))
    nodes = [helper.make_node("MatMul", ["a", "w"], ["h"]),
             helper.make_node("Add", ["h", "bias"], ["hb"]),
             helper.make_node("Add", ["hb", "r"], ["s"]),
             helper.make_node("Relu", ["s"], ["y"])]
    vb, mr, nr = tile
    schedule = Schedule(vector_bytes=vb, gemm_mr=mr, gemm_nr=nr, gemm_mc=2 * mr,
                        gemm_nc=2 * nr, gemm_kc=5, gemm_l2_bytes=0)
    kernels = run_with(model(nodes, spec, ["y"], {"w": w, "bias": bias}), spec, schedule)
    stage = next(s for k in kernels for s in k.schedule["stages"] if s.get("form") == "packed")
    if stage.get("order") == "row panels outermost":
        assert stage.get("epilogue") == "in registers" and stage["kc"] >= k
    else:
        assert stage.get("epilogue") == "per block" and "whole_tiles" not in stage


@pytest.mark.parametrize("tile", TILES, ids=lambda t: f"{t[1]}x{t[2]}v{t[0]}")
@pytest.mark.parametrize("batch", [1, 2])
def test_a_short_sum_into_a_large_output_streams_row_panels(tile, batch):
    """A 1 × 1 conv of few input channels onto more pixels than L2 holds (MobileNetV2's 16 to
    96 channels at 112 × 112, ResNet's 64 to 256 at 56 × 56) runs each row panel over a long run
    of columns, its whole tiles' bias, residual and ReLU applied in registers (the residual read
    per tile, rows apart), its ragged rows and columns through a one-tile local array."""
    _, mr, nr = tile
    cin, cout, h, w = 7, 2 * mr + 3, 9, 2 * nr + 16  # rows of whole vectors: B read in place
    spec = {"x": ((batch, cin, h, w), "float32"), "r": ((batch, cout, h, w), "float32")}
    rng = np.random.default_rng(mr * 31 + nr + batch)
    weights = rng.standard_normal((cout, cin, 1, 1)).astype(np.float32)
    bias = rng.standard_normal(cout).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "bias"], ["c"]),
             helper.make_node("Add", ["c", "r"], ["s"]),
             helper.make_node("Relu", ["s"], ["y"])]
    schedule = replace(small_blocks(tile), gemm_mc=2 * mr, gemm_nc=nr, gemm_kc=256,
                       gemm_l2_bytes=1024, conv_gemm_min_cout=1)
    kernels = run_with(model(nodes, spec, ["y"], {"w": weights, "bias": bias}), spec, schedule)
    stage = next(s for k in kernels for s in k.schedule["stages"] if s.get("form") == "packed")
    assert stage.get("order") == "row panels outermost"
    assert stage.get("epilogue") == "in registers" and stage["kc"] == cin


@pytest.mark.parametrize("tile", TILES, ids=lambda t: f"{t[1]}x{t[2]}v{t[0]}")
def test_epilogue_rows_of_whole_tiles_run_a_counted_vector_loop(tile):
    """Columns in whole micro-tiles: each epilogue row is a simd loop of exactly nr iterations
    from 0 (the C compiler sees the count), and the results still match."""
    _, mr, nr = tile
    spec = {"a": ((2 * mr + 1, 13), "float32")}
    w = np.random.default_rng(12).standard_normal((13, 2 * nr)).astype(np.float32)
    bias = np.random.default_rng(13).standard_normal(2 * nr).astype(np.float32)
    m = model([helper.make_node("MatMul", ["a", "w"], ["h"]),
               helper.make_node("Add", ["h", "bias"], ["y"])], spec, ["y"], {"w": w, "bias": bias})
    kernels = run_with(m, spec, small_blocks(tile))
    assert any(re.search(rf"for \(int64_t j\d* = 0; j\d* < {nr}; ", k.source) for k in kernels)


def test_matrix_vector_products_are_dot_products():
    """One output column would waste all but one lane of each micro-kernel vector."""
    spec = {"x": ((1, 40, 1, 1), "float32")}
    w = np.random.default_rng(6).standard_normal((24, 40, 1, 1)).astype(np.float32)
    m = model([helper.make_node("Conv", ["x", "w"], ["y"])], spec, ["y"], {"w": w})
    kernels = run_with(m, spec, Schedule())
    assert "packed" not in forms(kernels) and "dot" in forms(kernels)


@settings(max_examples=12, deadline=None)
@given(m=st.integers(2, 3), k=st.integers(1, 40), n=st.integers(8, 70), trans_b=st.booleans(),
       width=st.sampled_from([8, 16, 64]))
def test_few_rows_times_constant_weights_stream_column_panels(m, k, n, trans_b, width):
    """Too few rows for the packed GEMM: the weights, plain or transposed, are gathered into
    panels of the tile's columns (a ragged last one zero-padded), each tile reading its panel as
    one stream; bias and activation after."""
    spec = {"a": ((m, k), "float32")}
    rng = np.random.default_rng(m * 131 + k * 7 + n)
    w = rng.standard_normal((n, k) if trans_b else (k, n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    nodes = [helper.make_node("Gemm", ["a", "w", "bias"], ["h"], transB=int(trans_b)),
             helper.make_node("Tanh", ["h"], ["y"])]
    kernels = run_with(model(nodes, spec, ["y"], {"w": w, "bias": bias}), spec,
                       Schedule(matmul_tile_n=width))
    stage = next(s for k in kernels for s in k.schedule["stages"] if s.get("form") == "ikj")
    assert stage["b_operand"] == "constant in column panels"


@settings(max_examples=16, deadline=None)
@given(k=st.integers(1, 300), n=st.integers(8, 300), trans_b=st.booleans(),
       activation=st.sampled_from(["Relu", "Tanh"]), tile=st.sampled_from(TILES))
def test_one_row_times_constant_weights_runs_one_row_tiles(k, n, trans_b, activation, tile):
    """A vector times weights (a classifier head): the packed GEMM with one-row tiles of 8
    vectors over the weights pre-packed in panels, A read in place; a ragged last panel, slices
    of the sum, and the epilogue in registers (ReLU) or through the tile (Tanh)."""
    vb, _, _ = tile
    spec = {"a": ((1, k), "float32")}
    rng = np.random.default_rng(k * 7 + n)
    w = rng.standard_normal((n, k) if trans_b else (k, n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    nodes = [helper.make_node("Gemm", ["a", "w", "bias"], ["h"], transB=int(trans_b)),
             helper.make_node(activation, ["h"], ["y"])]
    kernels = run_with(model(nodes, spec, ["y"], {"w": w, "bias": bias}), spec,
                       Schedule(vector_bytes=vb, gemm_kc=64, gemm_l2_bytes=0))
    stage = next(s for k in kernels for s in k.schedule["stages"] if s.get("form") == "packed")
    assert stage["micro_kernel"] == f"1x{8 * vb // 4}"
    assert stage["b_operand"] == "pre-packed constant" and stage["a_operand"] == "read in place"


@pytest.mark.parametrize("mr, prefetches", [(1, False), (2, True), (12, True)])
def test_only_kernels_of_several_rows_ask_for_their_streams_ahead(mr, prefetches):
    """A one-row kernel loads a vector of B per FMA: requests ahead would take its load slots for
    one sequential stream (an LSTM's recurrent sums ran 0.85x the time without them). A
    pixel-rows kernel's last row keeps them (ResNet-50's 14 × 14 convs ran faster with them)."""
    source = vector_extension_source(tile_for(("avx512f",), "float32", 64, mr, 128))
    assert ("__builtin_prefetch(ahead + " in source) == prefetches
    pixel_rows = pixel_rows_source(replace(tile_for(("avx512f",), "float32", 64, mr, 32),
                                           pixel_rows=True))
    assert "__builtin_prefetch(b + " in pixel_rows


def _prefetched_lines(kernel: MicroKernel, kc: int, ldb: int, tmp_path) -> set[int]:
    """The float offsets from B of the lines one call of the micro-kernel asks for ahead."""
    body = (f"  float *a = calloc({kc * kernel.mr + 4096}, 4), *b = calloc({kc * ldb + 4096}, 4);\n"
            f"  float *c = calloc({kernel.mr * kernel.nr}, 4);\n"
            f"  {kernel.function}({kc}, a, b, {ldb}, c, {kernel.nr}, 0);")
    return prefetched_offsets(kernel, body, kc * ldb + 4096, tmp_path)


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc")
@pytest.mark.parametrize("kc, ldb", [(16, 1000), (40, 1000), (16, 32), (100, 32)])
def test_b_is_asked_for_ahead_where_the_next_calls_read_it(kc, ldb, tmp_path):
    """Each step asks for B's row `PREFETCH_STEPS` steps on: in the call's own columns while the
    sum lasts, then in the next call's, whose tile starts `nr` columns on, at row 0, in rows read
    in place (ldb > nr) and right after this panel in packed ones (ldb = nr). Rows past the sum in
    the same columns were asked for before: with a sum shorter than the distance (MobileNetV2's
    1 × 1 convs of 16 and 32 channels at 112²) not one request was for a line a kernel reads."""
    kernel = tile_for(("avx512f",), "float32", 64, 12, 32)
    want = set()
    for k in range(kc):
        tile, row = divmod(k + PREFETCH_STEPS, kc)
        start = (tile * kc + row) * ldb if ldb == kernel.nr else tile * kernel.nr + row * ldb
        want |= {start + e for e in range(0, kernel.nr, 16)}
    assert _prefetched_lines(kernel, kc, ldb, tmp_path) == want


@pytest.mark.parametrize("k, n, threads", [(768, 768, 1), (1100, 1000, 2)])
def test_one_row_times_a_few_megabytes_of_weights_runs_on_one_thread(k, n, threads):
    """Waking a second thread costs more than half of a short stream of weights."""
    from kiln.codegen.gemm.packed import SERIAL_ROW_WEIGHT_BYTES
    assert (k * n * 4 <= SERIAL_ROW_WEIGHT_BYTES) == (threads == 1)
    spec = {"a": ((1, k), "float32")}
    w = np.random.default_rng(3).standard_normal((k, n)).astype(np.float32)
    m = model([helper.make_node("MatMul", ["a", "w"], ["y"])], spec, ["y"], {"w": w})
    kernels = run_with(m, spec, Schedule())
    assert forms(kernels) == {"packed"}
    assert any("kiln_parallel_for(" in k.source for k in kernels) == (threads == 2)


def test_one_row_with_a_prologue_times_weights_packs_its_row():
    """A row computed by a fused prologue (a Sigmoid) is packed once, as a one-row panel."""
    spec = {"a": ((1, 300), "float32")}
    w = np.random.default_rng(1).standard_normal((300, 130)).astype(np.float32)
    nodes = [helper.make_node("Sigmoid", ["a"], ["s"]), helper.make_node("MatMul", ["s", "w"], ["y"])]
    kernels = run_with(model(nodes, spec, ["y"], {"w": w}), spec,
                       Schedule(gemm_kc=64, gemm_l2_bytes=0))
    stage = next(s for k in kernels for s in k.schedule["stages"] if s.get("form") == "packed")
    assert stage["micro_kernel"].startswith("1x") and stage["a_operand"] == "packed in scratch"


def test_one_row_times_an_activation_is_not_a_packed_gemm():
    """A run-time B would be packed for a single use of each element: the ikj loop nest reads it."""
    spec = {"a": ((1, 24), "float32"), "b": ((24, 40), "float32")}
    m = model([helper.make_node("MatMul", ["a", "b"], ["y"])], spec, ["y"])
    assert "packed" not in forms(run_with(m, spec, Schedule()))


def test_attention_scores_transposed_operand():
    spec = {"q": ((2, 3, 17, 8), "float32"), "k": ((2, 3, 17, 8), "float32")}
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["s"]),
             helper.make_node("Softmax", ["s"], ["y"], axis=-1)]
    kernels = run_with(model(nodes, spec, ["y"]), spec, small_blocks(TILES[1]))
    assert "packed" in forms(kernels)


@pytest.mark.parametrize("tile", TILES, ids=lambda t: f"{t[1]}x{t[2]}v{t[0]}")
def test_transposed_activation_b_is_copied_by_the_tasks(tile):
    """Q·Kᵀ: B contiguous along the sum is copied block by block (slices of the sum, ragged
    columns) by the tasks that read it."""
    spec = {"q": ((2, 3, 17, 12), "float32"), "k": ((2, 3, 19, 12), "float32")}
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["y"])]
    kernels = run_with(model(nodes, spec, ["y"]), spec, small_blocks(tile))
    stage = next(s for k in kernels for s in k.schedule["stages"] if s.get("form") == "packed")
    assert stage["b_operand"] == "copied by the tasks"


def test_gemm_transposed_weights_alpha_beta():
    spec = {"a": ((19, 11), "float32")}
    rng = np.random.default_rng(3)
    inits = {"w": rng.standard_normal((23, 11)).astype(np.float32),
             "c": rng.standard_normal((23,)).astype(np.float32)}
    m = model([helper.make_node("Gemm", ["a", "w", "c"], ["y"], transB=1, alpha=0.5, beta=2.0)],
              spec, ["y"], inits)
    assert "packed" in forms(run_with(m, spec, small_blocks(TILES[0])))


@pytest.mark.parametrize("spatial,strides,pads,group,dil,winograd,form", [
    ((9, 11), (1, 1), (1, 1, 1, 1), 1, (1, 1), True, "Winograd F(2x2, 3x3)"),
    ((9, 22), (1, 1), (1, 1, 1, 1), 1, (1, 1), False, "direct GEMM"),
    # on 9 × 11 the direct kernel's grid holds 117 pixels for 99: pixels as rows
    ((9, 11), (1, 1), (1, 1, 1, 1), 1, (1, 1), False, "direct, pixels as rows"),
    ((9, 11), (2, 2), (0, 1, 1, 0), 1, (1, 1), True, "direct GEMM"),
    ((5, 60), (1, 1), (2, 2, 2, 2), 2, (2, 2), True, "direct GEMM"),
    ((9, 11), (1, 1), (2, 2, 2, 2), 2, (2, 2), True, "direct, pixels as rows"),
    ((21,), (2,), (1, 2), 1, (1,), True, "packed"),  # 1-D: the implicit GEMM
    ((5, 6, 7), (1, 2, 1), (1, 0, 1, 1, 1, 0), 2, (1, 1, 2), True, "packed"),  # 3-D likewise
])
def test_convolution_as_gemm(spatial, strides, pads, group, dil, winograd, form):
    """Convs as GEMMs with cache blocks of one micro-tile and slices of 5 along the sum."""
    spec = {"x": ((2, 4, *spatial), "float32")}
    rng = np.random.default_rng(4)
    kernel = (3,) * len(spatial)
    inits = {"w": rng.standard_normal((32, 4 // group, *kernel)).astype(np.float32),
             "b": rng.standard_normal(32).astype(np.float32)}
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], strides=strides, pads=pads,
                              group=group, dilations=dil),
             helper.make_node("Relu", ["c"], ["y"])]
    kernels = run_with(model(nodes, spec, ["y"], inits), spec,
                       small_blocks(TILES[1], conv_winograd=winograd))
    assert form in forms(kernels)


def test_float64_matmul():
    spec = {"a": ((9, 7), "float64")}
    w = np.random.default_rng(5).standard_normal((7, 21))
    m = model([helper.make_node("MatMul", ["a", "w"], ["y"])], spec, ["y"], {"w": w})
    assert "packed" in forms(run_with(m, spec, Schedule(vector_bytes=64, gemm_mr=4, gemm_nr=16)))


def test_tile_choice_follows_the_isa():
    assert (tile_for(("avx512f", "avx2"), "float32").mr, tile_for(("avx512f",), "float32").nr) == (12, 32)
    assert tile_for(("avx2", "fma"), "float32") == MicroKernel("float32", 6, 16, 32)
    assert tile_for(("neon",), "float32") == MicroKernel("float32", 8, 12, 16)
    assert tile_for((), "float32").vector_bytes == 16
    # float64 has half the lanes: nr stays a whole number of vectors
    assert tile_for(("neon",), "float64").nr % 2 == 0


def test_micro_kernel_register_budget():
    """Accumulators + B vectors + one broadcast fit the register file of each ISA (32 zmm, 16 ymm,
    32 NEON q registers), so nothing spills in the inner loop."""
    registers = {64: 32, 32: 16, 16: 32}
    for _, vb, mr, nr in ISA_TILES:
        vectors = nr // (vb // 4)
        assert mr * vectors + vectors + 1 <= registers[vb]


def test_micro_kernel_source_rejects_partial_vectors():
    with pytest.raises(ValueError):
        vector_extension_source(MicroKernel("float32", 4, 12, 32))


def test_blocking_keeps_threads_busy_and_blocks_even():
    uk = MicroKernel("float32", 12, 32, 64)
    b = blocking(128, 768, 3072, 1, uk, 96, 256, 256)
    assert b.mc % 12 == 0 and b.nc % 32 == 0 and b.kc == 256
    assert -(-128 // b.mc) * -(-768 // b.nc) >= 8
    assert 128 - (-(-128 // b.mc) - 1) * b.mc >= b.mc // 2  # no thin leftover row block
    assert blocking(1000, 64, 1000, 1, uk, 96, 256, 256).kc == 250
    # a late convolution (512 output channels, 7×7 pixels): split along M, so the 9 MB of
    # weights are read once and only the small im2col operand is shared between tasks
    late = blocking(512, 49, 4608, 1, uk, 96, 256, 256)
    assert late.nc >= 49 and -(-512 // late.mc) >= 8
    # 256 channels at 14×14: A and B are alike, so neither is re-read by many blocks
    mid = blocking(256, 196, 2304, 1, uk, 96, 256, 256)
    assert -(-256 // mid.mc) <= 4 and -(-196 // mid.nc) <= 4


@pytest.mark.parametrize("m,n", [(197, 768), (128, 768), (257, 768), (50, 3072), (197, 3072),
                                 (1, 1000), (6, 16), (31, 200)])
def test_balanced_blocking_splits_evenly_over_2_and_4_threads(m, n):
    """Equal tasks over 2 and 4 threads (BALANCE_THREADS) leave at most IDLE_SHARE of their time
    idle, unless
    the blocks are single micro-tiles already; without `balance` the blocks stay as large as
    `min_tasks` allows (197 rows in 66-row blocks by 256 columns: 9 tasks, a quarter of 4
    threads' time idle)."""
    uk = MicroKernel("float32", 6, 16, 32)
    b = blocking(m, n, 768, 1, uk, 96, 256, 256, balance=True)
    assert b.mc % 6 == 0 and b.nc % 16 == 0
    tasks = -(-m // b.mc) * -(-n // b.nc)
    assert tasks >= 8 or (b.mc, b.nc) == (6, 16)
    if (b.mc, b.nc) != (6, 16):
        assert all(idle_share(tasks, t) <= IDLE_SHARE for t in (2, BALANCE_THREADS))
    plain = blocking(m, n, 768, 1, uk, 96, 256, 256)
    assert plain.mc >= b.mc and plain.nc >= b.nc


def test_unbalanced_blocking_of_a_vit_product():
    uk = MicroKernel("float32", 6, 16, 32)
    plain = blocking(197, 768, 768, 1, uk, 96, 256, 256)
    assert -(-197 // plain.mc) * -(-768 // plain.nc) == 9 and idle_share(9, 4) > IDLE_SHARE
    assert idle_share(9, 2) == pytest.approx(0.1) and idle_share(36, 8) <= IDLE_SHARE


def test_recurrent_input_projection_records_its_gemm_on_its_own_stage():
    seq, batch, features, hidden = 5, 2, 6, 4
    rng = np.random.default_rng(4)
    spec = {"x": ((seq, batch, features), "float32")}
    weights = {"w": rng.standard_normal((1, 4 * hidden, features)).astype(np.float32),
               "r": rng.standard_normal((1, 4 * hidden, hidden)).astype(np.float32)}
    m = model([helper.make_node("LSTM", ["x", "w", "r"], ["y"], hidden_size=hidden)],
              spec, ["y"], weights)
    kernels = run_with(m, spec, Schedule())
    stages = kernels[0].schedule["stages"]
    packed = [s for s in stages if s.get("form") == "packed"]
    assert [s["stage"] for s in packed] == ["contraction LSTM (op0), packed GEMM"]
    assert not any("micro_kernel" in s for s in stages if s["stage"].startswith("LSTM"))


@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("pixels", [(8, 12), (5, 8)])
def test_few_output_channels_run_the_least_padding_tile(clip, pixels):
    """A 1 × 1 conv of 16 output channels with AVX2's 6 × 16 tile runs 4 × 24 tiles instead (as
    many FMAs per step of the sum, no padding to 18 rows); its pixels are read in place also when
    they are not whole 24-column panels (40 pixels: the last panel runs a kernel of its vectors);
    bias and ReLU6 after."""
    spec = {"x": ((1, 12, *pixels), "float32")}
    rng = np.random.default_rng(sum(pixels))
    w = rng.standard_normal((16, 12, 1, 1)).astype(np.float32)
    bias = rng.standard_normal(16).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c" if clip else "y"])]
    if clip:
        nodes.append(helper.make_node("Clip", ["c", "lo", "hi"], ["y"]))
    constants = {"w": w, "b": bias, "lo": np.float32(0), "hi": np.float32(6)}
    kernels = run_with(model(nodes, spec, ["y"], constants), spec,
                       Schedule(vector_bytes=32, gemm_mr=6, gemm_nr=16, gemm_mc=8, gemm_nc=48))
    stage = next(s for k in kernels for s in k.schedule["stages"] if s.get("form") == "packed")
    assert (stage["micro_kernel"], stage["b_operand"]) == ("4x24", "read in place")


@pytest.mark.parametrize("size, tile", [(7, "7x48"), (14, "12x32")])
def test_pixels_as_rows_run_the_tile_whose_panels_they_fill(size, tile):
    """AVX-512: a 7 × 7 image's 49 pixels as a 1 × 1 conv's rows fill seven 7 × 48 panels, where
    6 × 64 pads them to 54 rows (MobileNetV2's 1 × 1 convs onto 7 × 7 took 0.90-0.93× the time
    in the model, ResNet-50's 7 × 7 stage 0.96×). A 14 × 14 image's 196 stay in 12 × 32 panels
    (204 rows): 7 × 48 would save less than `TILE_SAVING`, and ResNet-50's 1 × 1 convs onto
    14 × 14 took 1.03× the time in it. Bias and ReLU6 after, against the reference."""
    spec = {"x": ((1, 160, size, size), "float32")}
    rng = np.random.default_rng(size)
    constants = {"w": rng.standard_normal((96, 160, 1, 1)).astype(np.float32),
                 "b": rng.standard_normal(96).astype(np.float32),
                 "lo": np.float32(0), "hi": np.float32(6)}
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"]),
             helper.make_node("Clip", ["c", "lo", "hi"], ["y"])]
    kernels = run_with(model(nodes, spec, ["y"], constants), spec,
                       Schedule(vector_bytes=64, gemm_mr=12, gemm_nr=32))
    stage = next(s for k in kernels for s in k.schedule["stages"] if s.get("form") == "packed")
    assert stage["micro_kernel"] == tile


def test_padding_tiles_keep_enough_fma_chains():
    """Each ISA's tiles for padding: those of as many accumulators, then each with a row fewer
    while that keeps three quarters of them."""
    assert padding_tiles(tile_for(("avx512f",), "float32", 64)) == [
        (12, 32), (8, 48), (6, 64), (11, 32), (7, 48), (5, 64)]
    assert padding_tiles(tile_for(("avx2",), "float32", 32)) == [(6, 16), (4, 24), (5, 16), (3, 24)]


@pytest.mark.parametrize("compiler,flags,tile", [
    ("gcc", ("-mavx2", "-mfma"), MicroKernel("float32", 4, 24, 32)),
    ("aarch64-linux-gnu-gcc", ("-march=armv8-a",), MicroKernel("float32", 1, 64, 16)),
    ("aarch64-linux-gnu-gcc", ("-march=armv8-a",), MicroKernel("float32", 8, 12, 16)),
])
def test_micro_kernels_that_fill_the_register_file_compile(compiler, flags, tile, tmp_path):
    """A tile that needs every vector register pins its B vectors in registers (AVX2's 4 × 24);
    one whose B vectors cannot all stay there (a 1 × 64 NEON row: 16 of them, more operands than
    an asm takes) pins nothing. Each compiles for its ISA."""
    if shutil.which(compiler) is None:
        pytest.skip(f"no {compiler}")
    source = vector_extension_source(tile)
    vectors, accumulators = tile.nr // tile.lanes, tile.mr * tile.nr // tile.lanes
    exactly = (fits_registers(tile.vector_bytes, accumulators, vectors)
               and not fits_registers(tile.vector_bytes, accumulators + 1, vectors))
    assert ("__asm__" in source) == exactly
    path = tmp_path / "ukr.c"
    path.write_text("#include <stdint.h>\n" + source + "\n")
    subprocess.run([compiler, *flags, "-O2", "-c", str(path), "-o", str(tmp_path / "ukr.o")],
                   check=True, capture_output=True)


def test_gelu_after_a_reshape_of_a_gemm_runs_as_its_epilogue():
    # GPT-2's feed-forward: the Reshape and GELU move to the first Gemm's epilogue (dnnfusion),
    # and the second Gemm reads the activation through a view (weights beyond the L2 that row
    # tiles of both Gemms would re-read, so they stay two blocks).
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"]),
             helper.make_node("Reshape", ["h", "s3"], ["h3"]),
             helper.make_node("Gelu", ["h3"], ["g"], approximate="tanh"),
             helper.make_node("Reshape", ["g", "s2"], ["g2"]),
             helper.make_node("Gemm", ["g2", "w2", "b2"], ["z"])]
    weights = {"w1": rng.standard_normal((256, 1024)).astype(np.float32) / 16,
               "b1": rng.standard_normal(1024).astype(np.float32),
               "w2": rng.standard_normal((1024, 40)).astype(np.float32) / 32,
               "b2": rng.standard_normal(40).astype(np.float32),
               "s3": np.array([1, 37, 1024], np.int64), "s2": np.array([37, 1024], np.int64)}
    m = model(nodes, {"x": ((37, 256), "float32")}, ["z"], weights, opset=20)
    graph = frontend.build(m, {}, "test")
    assert [[graph.op_by_id[i].op_type for i in b.op_ids] for b in plan_for(graph, "dnnfusion").blocks] \
        == [["Gemm", "Reshape", "Gelu"], ["Reshape", "Gemm"]]
    check_model(m, random_inputs({"x": ((37, 256), "float32")}), ("none", "dnnfusion"))


@pytest.mark.parametrize("tile", TILES, ids=lambda t: f"{t[1]}x{t[2]}v{t[0]}")
def test_a_batch_packed_in_scratch_times_weights_is_one_product(tile):
    """A batch of A that must be packed (a transposed read) times one weight matrix: packed as one
    product of batch × M rows, its panels running on across batches, through the fused epilogue."""
    spec = {"a": ((2, 5, 9, 7), "float32")}
    rng = np.random.default_rng(3)
    w, bias = (rng.standard_normal((9, 19)).astype(np.float32),
               rng.standard_normal(19).astype(np.float32))
    m = model([helper.make_node("Transpose", ["a"], ["at"], perm=[0, 1, 3, 2]),
               helper.make_node("MatMul", ["at", "w"], ["h"]),
               helper.make_node("Add", ["h", "bias"], ["y"])], spec, ["y"], {"w": w, "bias": bias})
    kernels = run_with(m, spec, small_blocks(tile))
    stage = next(s for k in kernels for s in k.schedule["stages"] if s.get("form") == "packed")
    assert (stage["a_operand"], stage["product_rows"]) == ("packed in scratch", 70)


def test_products_of_one_kernel_pack_their_common_operand_once():
    """Three products of one transposed input (attention's Q, K and V projections of a window
    partition) in one kernel: its panels are packed once and read by all three."""
    spec = {"a": ((4, 12, 10), "float32")}
    rng = np.random.default_rng(5)
    weights = {f"w{n}": rng.standard_normal((12, 16)).astype(np.float32) for n in range(3)}
    nodes = [helper.make_node("Transpose", ["a"], ["at"], perm=[0, 2, 1])]
    nodes += [helper.make_node("MatMul", ["at", f"w{n}"], [f"y{n}"]) for n in range(3)]
    m = model(nodes, spec, ["y0", "y1", "y2"], weights)
    kernels = run_with(m, spec, Schedule())
    stages = [s for k in kernels for s in k.schedule["stages"]]
    packs = [s for s in stages if s["stage"].startswith("pack operand A")]
    products = [s for s in stages if s.get("form") == "packed"]
    assert len(kernels) == 1 and len(products) == 3 and len(packs) == 1
    assert [s["a_operand"] for s in products] == (
        ["packed in scratch"] + 2 * ["packed in scratch by an earlier product"])


def test_a_lowering_attempt_packs_its_own_operands(monkeypatch):
    """A block lowered again (an attempt that stored too little is retried from scratch) packs the
    common operand again in its own stages: panels packed by an abandoned attempt are gone."""
    from kiln.codegen.lower import BlockLowering
    once = BlockLowering.lower

    def retried(self):
        once(self)  # an abandoned first attempt
        return once(self)

    monkeypatch.setattr(BlockLowering, "lower", retried)
    test_products_of_one_kernel_pack_their_common_operand_once()


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc")
@pytest.mark.parametrize("tiles, kc", [(11, 256), (2, 40), (4, 7)])
def test_row_panels_ask_for_their_shares_of_the_next_slice(tiles, kc, tmp_path):
    """The row panels of a block each ask for a share of the next slice of B's panels (rows
    `nr` apart in a panel): together every line of it, none of the slice they read."""
    kernel = replace(tile_for(("avx512f",), "float32", 64, 12, 32), b_spread=-(-32 // tiles))
    body = (f"  float *a = calloc({kc * 12 + 4096}, 4), *b = calloc({3 * kc * 32}, 4);\n"
            "  float *c = calloc(384, 4);\n")
    body += "\n".join(f"  {kernel.function}({kc}, a, b, 32, c, 32, 0, "
                       f"b + {kc * 32 + t * kernel.b_spread * kc});" for t in range(tiles))
    asked = {o // 16 for o in prefetched_offsets(kernel, body, 3 * kc * 32, tmp_path)}
    assert set(range(kc * 2, 2 * kc * 2)) <= asked and not asked & set(range(kc * 2))


def test_a_product_over_constant_panels_spreads_its_requests():
    """128 rows (blocks of several row panels) times a constant 256 × 320 weight matrix in
    slices of 64: every tile's kernel, the last rows' too, asks for its share of the next slice
    (`b_spread` in its name), and the product matches onnxruntime across panels, blocks and
    slices."""
    spec = {"x": ((128, 256), "float32")}
    w = np.random.default_rng(5).standard_normal((256, 320)).astype(np.float32)
    m = model([helper.make_node("MatMul", ["x", "w"], ["y"])], spec, ["y"], {"w": w})
    kernels = run_with(m, spec, Schedule(vector_bytes=64, gemm_mr=12, gemm_nr=32, gemm_kc=64,
                                         gemm_nc=128, gemm_l2_bytes=0))
    called = set(re.findall(r"kiln_ukr_\w+?_v64\(", "\n".join(k.source for k in kernels)))
    assert called and all(re.search(r"_p\d+_", name) for name in called), called


def test_gemm_tasks_split_evenly_by_default_and_by_demand_when_tuned_so():
    """A 1 × 1 conv's GEMM tasks go out as even runs (each thread the same pixels the kernels
    around it gave it) unless the schedule asks for them on demand; the result is the same."""
    spec = {"x": ((1, 64, 20, 20), "float32")}
    w = np.random.default_rng(3).standard_normal((96, 64, 1, 1)).astype(np.float32)
    m = model([helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[1, 1])], spec, ["y"],
              {"w": w})
    default = backend_for(host_target()).schedule
    assert Schedule().gemm_omp_schedule == default.gemm_omp_schedule == "static"
    for schedule, mode in ((default, "KILN_POOL_EVEN"),
                           (replace(default, gemm_omp_schedule="dynamic"), "KILN_POOL_DYNAMIC")):
        kernels = run_with(m, spec, schedule)
        assert "packed" in forms(kernels)
        calls = re.findall(r"kiln_parallel_for\([^;]*?(KILN_POOL_\w+)\)", kernels[0].source)
        assert calls and set(calls) == {mode}, calls
