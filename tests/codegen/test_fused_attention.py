"""Fused attention (`kiln.codegen.ops.fused_attention`): MatMul → scale/bias/mask → Softmax →
MatMul chains, recognised from the graph, planned as one block by dnnfusion and lowered as one
stage, against onnxruntime on random shapes: heads, sequence lengths that are not multiples of the
vector width, head sizes, masks (additive, boolean, causal) and none."""
from __future__ import annotations

import re

from dataclasses import fields

import numpy as np
import pytest
from onnx import helper
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln import frontend
from kiln.codegen import generate
from kiln.codegen.microkernel import MicroKernel
from kiln.codegen.ops.fused_attention import (_reading_in_place, micro_kernel_for, panel_rows,
                                              row_tiling, tile_columns)
from kiln.codegen.schedule import Schedule
from kiln.plan.chains import attention_chains
from bench.attention import ADDITIVE, BIAS, BOOLEAN, CAUSAL, attention_model
from kiln.target import host_target
from tests.codegen.harness import assert_matches, plan_for, reference, run_kernels


def fused_stages(kernels) -> list[dict]:
    return [s for k in kernels for s in k.schedule["stages"] if s.get("form") == "fused attention"]


CASES = [  # batch, heads, q_len, kv_len, head, value, mask, packed_q, transpose_k
    (1, 2, 7, 7, 8, 8, None, False, False),
    (2, 3, 49, 49, 32, 32, BIAS, True, False),  # Swin windows: a relative-position bias
    (1, 4, 37, 53, 16, 24, BOOLEAN, False, True),  # lengths off the vector width
    (1, 2, 33, 33, 64, 64, CAUSAL, True, True),  # GPT-2: causal mask, K transposed in the graph
    (1, 1, 70, 19, 5, 3, ADDITIVE, False, False),  # several row tiles, odd head sizes
    (3, 1, 1, 17, 8, 8, None, False, False),  # one query row (decoding)
    (1, 2, 20, 300, 8, 8, ADDITIVE, True, False),  # many keys: row tiles of one micro-tile
    (2, 1, 70, 40, 8, 8, BOOLEAN, True, False),  # an input mask per batch element, several tiles
    (1, 2, 197, 197, 64, 64, None, True, True),  # ViT: 197 rows, Q and K read a row at a time
    (2, 3, 45, 51, 24, 40, ADDITIVE, True, True),  # rows of Q and K off the vector width
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:6])) + f"-{c[6]}")
def test_fused_attention_matches_onnxruntime(case):
    onnx_model, inputs = attention_model(*case)
    graph = frontend.build(onnx_model, {}, "attention")
    plan = plan_for(graph, "dnnfusion")
    chains = attention_chains(graph)
    assert len(chains) == 1
    assert any(set(chains[0].op_ids) <= set(b.op_ids) for b in plan.blocks)
    kernels = generate(plan, host_target())
    assert len(fused_stages(kernels)) == 1
    if case[6] in (CAUSAL, BIAS) and case[2] > 1:  # a constant varying down the score columns
        fused = next(k for k in kernels if fused_stages([k]))
        assert fused.derived_constants, "the constant is not read in the loop order"
    if case[6] == BOOLEAN and case[2] > 1:  # an input varying down the score columns
        fused = next(k for k in kernels if fused_stages([k]))
        assert any("loop order of the scores" in s["stage"] for s in fused.schedule["stages"]), \
            "the mask is not copied in the loop order"
    values = run_kernels(plan, kernels, dict(zip(graph.inputs, inputs.values())))
    assert_matches([values[t] for t in graph.outputs], reference(onnx_model, inputs))


def _fused_matches_onnxruntime(case) -> tuple[dict, MicroKernel]:
    """The fused attention stage of the case's kernel and the kernel's GEMM micro-kernel, after
    checking the outputs against onnxruntime."""
    onnx_model, inputs = attention_model(*case)
    graph = frontend.build(onnx_model, {}, "attention")
    kernels = generate(plan := plan_for(graph, "dnnfusion"), host_target())
    fused = [k for k in kernels if fused_stages([k])]
    assert len(fused) == 1 and len(fused_stages(fused)) == 1
    values = run_kernels(plan, kernels, dict(zip(graph.inputs, inputs.values())))
    assert_matches([values[t] for t in graph.outputs], reference(onnx_model, inputs))
    known = {f.name for f in fields(Schedule)}
    schedule = Schedule(**{k: v for k, v in fused[0].schedule.items() if k in known})
    return fused_stages(fused)[0], micro_kernel_for(schedule, "float32")


@settings(max_examples=10, deadline=None)
@given(heads=st.integers(1, 3), q_len=st.integers(1, 130), kv_len=st.integers(1, 90),
       head=st.integers(1, 40), value=st.integers(1, 90),
       mask=st.sampled_from([None, ADDITIVE, BIAS]), packed_q=st.booleans())
def test_fused_attention_with_short_panels_matches_onnxruntime(heads, q_len, kv_len, head, value,
                                                               mask, packed_q):
    """Key and value counts for which K and V run in panels shorter than the micro-kernel's rows
    (`panel_rows`), each product with its own micro-kernel; query lengths whose tiles are one
    vector wide (`tile_columns`)."""
    stage, uk = _fused_matches_onnxruntime((1, heads, q_len, kv_len, head, value, mask,
                                            packed_q, False))
    keys, values = (int(tile.split("x")[0]) for tile in stage["micro_kernel"].split(", "))
    assert keys == panel_rows(kv_len, uk.mr)
    if stage["values"] != "rows read in place":  # Oᵀ = Vᵀ · Pᵀ, V's columns in panels
        assert values == panel_rows(value, uk.mr)


@pytest.mark.parametrize("case", CASES[:4] + CASES[-2:],
                         ids=lambda c: "x".join(map(str, c[:6])) + f"-{c[6]}")
def test_keys_and_values_that_are_plain_loads_are_read_in_place(case):
    """K (as K or as Kᵀ) and V straight from the block's inputs, through Reshapes and Transposes,
    are the micro-kernels' operands where they lie: no panels are packed, and V's rows are the
    second product's B wherever a row is whole vectors (O = P·V, stored along O's rows)."""
    stage, uk = _fused_matches_onnxruntime(case)
    lanes = uk.lanes
    assert stage["keys"] == "read in place"
    assert stage["values"] == ("rows read in place" if case[5] % lanes == 0 else "read in place")
    assert ("(P·V)" in stage["micro_kernel"]) == (case[5] % lanes == 0)


@pytest.mark.parametrize("computed", [False, True])
def test_queries_that_are_a_plain_load_are_transposed_by_blocks(computed):
    """Qᵀ of a row tile comes from the vectorised block transpose where Q is a tensor read as it
    lies, and from the element loops where the block computes it (a Relu ahead of the product)."""
    spec = {"q": ((1, 2, 37, 16), "float32"), "kt": ((1, 2, 16, 24), "float32"),
            "v": ((1, 2, 24, 32), "float32")}
    nodes = [helper.make_node("Relu", ["q"], ["qr"])] if computed else []
    nodes += [helper.make_node("MatMul", ["qr" if computed else "q", "kt"], ["s"]),
              helper.make_node("Softmax", ["s"], ["p"], axis=-1),
              helper.make_node("MatMul", ["p", "v"], ["y"])]
    fused = _one_fused_kernel_matching_onnxruntime(nodes, spec)
    assert ("kiln_transpose_" in fused.source) != computed


def test_keys_and_values_computed_in_the_block_are_packed():
    """A K and a V that the block computes (a Relu fused ahead of each product) are no tensor to
    read in place: both go into panels, and the result still matches onnxruntime."""
    spec = {"q": ((1, 2, 20, 16), "float32"), "kt": ((1, 2, 16, 24), "float32"),
            "v": ((1, 2, 24, 32), "float32")}
    nodes = [helper.make_node("Relu", ["kt"], ["kr"]), helper.make_node("Relu", ["v"], ["vr"]),
             helper.make_node("MatMul", ["q", "kr"], ["s"]),
             helper.make_node("Softmax", ["s"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "vr"], ["y"])]
    stages = fused_stages([_one_fused_kernel_matching_onnxruntime(nodes, spec)])
    assert len(stages) == 1 and (stages[0]["keys"], stages[0]["values"]) == ("packed", "packed")


def _one_fused_kernel_matching_onnxruntime(nodes, spec):
    """The one kernel with a fused attention stage in the dnnfusion build of a graph of `nodes`
    over the inputs `spec` (output "y"), after checking its outputs against onnxruntime."""
    from tests.codegen.harness import model, random_inputs
    onnx_model = model(nodes, spec, ["y"], {})
    inputs = random_inputs(spec)
    graph = frontend.build(onnx_model, {}, "attention")
    kernels = generate(plan := plan_for(graph, "dnnfusion"), host_target())
    fused = [k for k in kernels if fused_stages([k])]
    assert len(fused) == 1
    values = run_kernels(plan, kernels, dict(zip(graph.inputs, inputs.values())))
    assert_matches([values[t] for t in graph.outputs], reference(onnx_model, inputs))
    return fused[0]


@pytest.mark.parametrize("rows, steps, kind", [
    (768, 1, "lda"),  # K [n, H·D]: rows of key positions a BERT hidden size apart
    (1, 128, "a_step"),  # Kᵀ [d, n] or V [n, dv]: each step of the sum a row
    (1024, 1, None),  # rows 4 KiB apart: 12 rows' lines in one L1 set of 8 ways
    (64, 2, None),  # neither rows nor steps contiguous (a strided view)
])
def test_an_operand_is_read_in_place_along_its_contiguous_axis(rows, steps, kind):
    uk = MicroKernel("float32", 12, 32, 64)
    kernel = _reading_in_place(uk, rows, steps)
    assert (kernel is None) == (kind is None)
    if kind == "lda":
        assert (kernel.lda, kernel.a_step) == (rows, 0)
    elif kind == "a_step":
        assert (kernel.lda, kernel.a_step) == (0, steps)


@pytest.mark.parametrize("mr", [4, 8, 12, 14])
def test_panel_rows_pad_no_more_than_whole_micro_kernel_panels(mr):
    for extent in range(1, 700):
        rows = panel_rows(extent, mr)
        assert (mr + 1) // 2 <= rows <= mr or rows == extent < mr
        assert -(-extent // rows) * rows <= -(-extent // mr) * mr
        assert -(-extent // rows) <= 2 * -(-extent // mr)


@pytest.mark.parametrize(("extent", "rows"), [(64, 11), (128, 12), (197, 11), (49, 10), (32, 11)])
def test_panel_rows_trades_padding_against_panels(extent, rows):
    """64 value columns: 6 panels of 11 rather than 6 of 12 (8 rows of zeros) or 8 of 8 (two more
    micro-tiles); 128 keys: 11 panels of 12 rather than 16 of 8."""
    assert panel_rows(extent, 12) == rows


@pytest.mark.parametrize(("m", "most", "columns"), [
    (197, 32, 16),  # 13 tiles of 16 rows: 208 columns, not 7 of 29 padded to 32: 224
    (128, 32, 32),  # no padding either way: the larger tiles
    (49, 64, 64),  # one tile of 49 rows: 64 columns, as two or four tiles would pad
    (7, 16, 16),
])
def test_tile_columns_pad_least(m, most, columns):
    assert tile_columns(m, most, 16) == columns


@pytest.mark.parametrize(("m", "keys", "tiling"), [
    (197, 198, (13, 16, 16, 16)),  # ViT: 13 tiles at 6x16, not 5 of 40 at 6x8 (1.75x slower)
    (128, 132, (4, 32, 32, 16)),  # BERT: unchanged
    (49, 50, (1, 49, 64, 16)),  # Swin windows: one tile
    (1, 17, (1, 1, 8, 8)),  # one query row: one vector, half the padded columns of 6x16's
])
def test_row_tiling_runs_whole_micro_tiles(m, keys, tiling):
    """(tiles, rows, rows_pad, nr) on AVX2's 6x16 micro-kernel, 12 heads."""
    assert row_tiling(m, keys * 4, 12, MicroKernel("float32", 6, 16, 32)) == tiling


@pytest.mark.parametrize(("m", "keys", "tiling"), [
    (197, 198, (13, 16, 16, 16)),  # ViT: 11x16 has FMA chains enough; 208 columns, not 224
    (128, 132, (4, 32, 32, 32)),  # BERT: no padding either way, the wider tiles
    (49, 50, (1, 49, 64, 32)),  # Swin windows: one tile
])
def test_row_tiling_on_avx512_pads_least_where_one_vector_keeps_the_fma_pipes_busy(m, keys,
                                                                                   tiling):
    """AVX-512's 12x32 micro-kernel: a one-vector tile still holds 12 accumulators (Zen 4, ViT's
    attention: 0.92x the time of 32-column tiles)."""
    assert row_tiling(m, keys * 4, 12, MicroKernel("float32", 12, 32, 64)) == tiling


@pytest.mark.parametrize("nr", [16, 24, 32])
def test_row_tiling_computes_no_more_than_one_vector_tiles(nr):
    """Padded columns over the micro-tile's vectors never exceed those of one-vector tiles, and
    the tiles cover the rows."""
    uk = MicroKernel("float32", 4, nr, 32)
    for m in range(1, 300, 7):
        tiles, rows, rows_pad, tile_nr = row_tiling(m, 400, 1, uk)
        assert tiles * rows >= m and rows_pad % tile_nr == 0 and tile_nr in (8, nr)
        one_vector = row_tiling(m, 400, 1, MicroKernel("float32", 4, 8, 32))
        assert tiles * rows_pad * nr / tile_nr <= one_vector[0] * one_vector[2] * nr / 8


@pytest.mark.parametrize("step", [8, 16])
def test_tile_columns_never_pad_more_than_the_largest_tiles(step):
    for m in range(1, 400):
        for most in range(step, 129, step):
            chosen = tile_columns(m, most, step)
            assert chosen <= most and chosen % step == 0

            def padded(limit):
                tiles = -(-m // limit)
                return tiles * -(-(-(-m // tiles)) // step) * step
            assert padded(chosen) <= padded(most)


@pytest.mark.parametrize("also_read", ["s", "p"])
def test_a_chain_whose_scores_are_read_elsewhere_is_no_chain(also_read):
    onnx_model, inputs = attention_model(1, 2, 8, 8, 8, 8, None, False, False,
                                         outputs=("y", also_read))
    graph = frontend.build(onnx_model, {}, "attention")
    assert attention_chains(graph) == []
    plan = plan_for(graph, "dnnfusion")
    kernels = generate(plan, host_target())
    assert fused_stages(kernels) == []
    values = run_kernels(plan, kernels, dict(zip(graph.inputs, inputs.values())))
    assert_matches([values[t] for t in graph.outputs], reference(onnx_model, inputs))


def test_a_bias_computed_per_call_is_copied_in_parallel():
    """BEiT: a relative-position bias made at run time with the heads innermost ([Lq, Lk, H],
    transposed to [1, H, Lq, Lk]) and added to the scores, eight heads (one group of row tiles per
    head): the copy in loop order runs on every thread (its outermost loop over the single group
    once fell away with the parallel flag), and the result matches onnxruntime."""
    from tests.codegen.harness import model, random_inputs
    heads, length, size = 8, 197, 16
    spec = {"q": ((1, heads, length, size), "float32"), "kt": ((1, heads, size, length), "float32"),
            "v": ((1, heads, length, size), "float32"),
            "table": ((length, length, heads), "float32")}
    nodes = [helper.make_node("MatMul", ["q", "kt"], ["s"]),
             helper.make_node("Mul", ["s", "scale"], ["scaled"]),
             helper.make_node("Relu", ["table"], ["rpb"]),  # computed at run time
             helper.make_node("Transpose", ["rpb"], ["bias3"], perm=[2, 0, 1]),
             helper.make_node("Unsqueeze", ["bias3", "zero"], ["bias"]),
             helper.make_node("Add", ["scaled", "bias"], ["biased"]),
             helper.make_node("Softmax", ["biased"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["y"])]
    onnx_model = model(nodes, spec, ["y"], {"scale": np.array(0.25, np.float32),
                                            "zero": np.array([0], np.int64)})
    inputs = random_inputs(spec)
    graph = frontend.build(onnx_model, {}, "attention")
    kernels = generate(plan := plan_for(graph, "dnnfusion"), host_target())
    fused = [k for k in kernels if fused_stages([k])]
    assert len(fused) == 1
    copy = fused[0].source.split("in the loop order of the scores */", 1)[1]
    assert re.match(r"\s*\{\s*\{\s*const \w+_ctx kiln_c = [^;]*;\s*kiln_parallel_for\(", copy), copy[:300]
    values = run_kernels(plan, kernels, dict(zip(graph.inputs, inputs.values())))
    assert_matches([values[t] for t in graph.outputs], reference(onnx_model, inputs))


def test_probabilities_below_the_normal_range_are_zero():
    """Scores spread over hundreds: most exp(s − max) fall below 2^-126, which the softmax's
    exp_flush makes 0 (onnxruntime's are denormals or 0), and the probabilities still match."""
    onnx_model, inputs = attention_model(1, 2, 19, 23, 8, 8, ADDITIVE, True, True)
    inputs = {**inputs, "x": inputs["x"] * 40}
    graph = frontend.build(onnx_model, {}, "attention")
    kernels = generate(plan := plan_for(graph, "dnnfusion"), host_target())
    assert len(fused_stages(kernels)) == 1
    values = run_kernels(plan, kernels, dict(zip(graph.inputs, inputs.values())))
    assert_matches([values[t] for t in graph.outputs], reference(onnx_model, inputs))
