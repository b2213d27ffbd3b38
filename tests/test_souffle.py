"""Souffle: quasi-affine map composition (§5.2, §6.2), the horizontal transformation (§6.1) against
onnxruntime, and the partitioner's rules (§5.4)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from kiln import frontend
from kiln.ops import op_info
from kiln.plan import partitioner
from kiln.plan.horizontal import horizontal_transform
from kiln.plan.souffle import Resources, Souffle
from kiln.plan.te import Dependence, IndexMap, fit, lower_program
from kiln.rewrite.export import run_onnxruntime
from tests.graphs import ecg, float_input, save_model
from tests.test_plan import RandomLatencies

ZOO = Path(__file__).resolve().parent / "fixtures" / "zoo"


def numpy_positions(shape, compute) -> np.ndarray:
    """The multi-index in `shape` each output element of `compute(iota)` comes from."""
    iota = np.arange(int(np.prod(shape))).reshape(shape)
    flat = compute(iota)
    index = np.stack(np.unravel_index(flat.reshape(-1), shape), axis=-1)
    return index.reshape(*flat.shape, len(shape))


def test_figure_4_chain_composes_to_one_matrix():
    """Relu → strided slice B[2i, j] → permute C[j, i]: D[i, j] = A[j, 2i] (the paper's Fig. 4)."""
    relu = IndexMap.affine((4, 8), (4, 8), np.eye(2), (0, 0))
    strided = IndexMap.affine((2, 4), (4, 8), [[2, 0], [0, 1]], (0, 0))
    permute = IndexMap.affine((4, 2), (2, 4), [[0, 1], [1, 0]], (0, 0))
    composed = permute.then(strided).then(relu)
    assert composed.matrix == ((0, 2), (1, 0))  # rows: input dims; columns: output dims
    assert composed.offset == (0, 0)
    expected = numpy_positions((4, 8), lambda a: a[::2, :4].T)
    assert np.array_equal(composed.table(), expected)


def test_affine_composition_matches_composing_tables():
    rng = np.random.default_rng(0)
    outer = IndexMap.affine((3, 5), (5, 3), [[0, 1], [1, 0]], (0, 0))
    inner = IndexMap.affine((5, 3), (7, 9), [[1, 0], [0, 2]], (1, 2))
    composed = outer.then(inner)
    for _ in range(10):
        v = (int(rng.integers(3)), int(rng.integers(5)))
        assert composed.apply(v) == inner.apply(outer.apply(v))


def test_a_reshape_that_merges_dims_is_quasi_affine_and_composes():
    """BERT's context: Transpose (0, 2, 1, 3) of [1, 2, 4, 3], then Reshape to [1, 4, 6]: the last
    output dim splits into digits (k = 3·k₁ + k₂)."""
    def positions(a):
        return a.transpose(0, 2, 1, 3).reshape(1, 4, 6)
    shape = (1, 2, 4, 3)
    transpose = fit(numpy_positions(shape, lambda a: a.transpose(0, 2, 1, 3)), (1, 4, 2, 3), shape)
    reshape = fit(numpy_positions((1, 4, 2, 3), lambda a: a.reshape(1, 4, 6)), (1, 4, 6),
                  (1, 4, 2, 3))
    assert transpose.is_affine and not reshape.is_affine
    assert reshape.split[2] == (2, 3)
    composed = reshape.then(transpose)
    assert composed is not None and composed.split[2] == (2, 3)
    assert np.array_equal(composed.table(), numpy_positions(shape, positions))


def test_a_map_that_is_not_quasi_affine_is_refused():
    """[2, 3] read as [3, 2]: row i starts at offset 2i, which crosses input rows unevenly."""
    assert fit(numpy_positions((2, 3), lambda a: a.reshape(3, 2)), (3, 2), (2, 3)) is None


def test_te_maps_are_read_off_the_ops():
    graph = ecg([("Relu", ["a"], ["b"]), ("Slice", ["b", "st", "en", "ax", "sp"], ["c"]),
                 ("Transpose", ["c"], ["d"])],
                {"a": (4, 8), "b": (4, 8), "c": (2, 4), "d": (4, 2), "st": (2,), "en": (2,),
                 "ax": (2,), "sp": (2,)},
                ["a"], ["d"],
                constants={"st": np.array([0, 0]), "en": np.array([4, 4]),
                           "ax": np.array([0, 1]), "sp": np.array([2, 1])})
    program = lower_program(graph)
    assert all(te.dependence is Dependence.ONE_RELIES_ON_ONE for te in program.exprs.values())
    composed = program.chain_map(["a", "b", "c", "d"])
    assert composed.matrix == ((0, 2), (1, 0))


def _three_projections(path: Path) -> Path:
    """x → three MatMuls (8 → 4, 6, 2) with bias Adds; two Convs sharing an input; outputs differ
    in what follows."""
    rng = np.random.default_rng(1)
    inits, nodes = [], []
    for i, n in enumerate((4, 6, 2)):
        inits += [numpy_helper.from_array(rng.standard_normal((8, n)).astype(np.float32), f"w{i}"),
                  numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), f"b{i}")]
        nodes += [helper.make_node("MatMul", ["x", f"w{i}"], [f"m{i}"]),
                  helper.make_node("Add", [f"m{i}", f"b{i}"], [f"y{i}"])]
    nodes.append(helper.make_node("Relu", ["y2"], ["r2"]))
    for i, c in enumerate((3, 5)):
        inits += [numpy_helper.from_array(rng.standard_normal((c, 2, 3, 3)).astype(np.float32),
                                          f"k{i}"),
                  numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), f"kb{i}")]
        nodes.append(helper.make_node("Conv", ["img", f"k{i}", f"kb{i}"], [f"c{i}"],
                                      pads=[1, 1, 1, 1]))
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n, shape in
               (("y0", (2, 5, 4)), ("y1", (2, 5, 6)), ("r2", (2, 5, 2)), ("c0", (1, 3, 6, 6)),
                ("c1", (1, 5, 6, 6)))]
    return save_model(path, nodes, [float_input("x", (2, 5, 8)), float_input("img", (1, 2, 6, 6))],
                      outputs, inits)


def test_horizontal_merge_matches_onnxruntime(tmp_path):
    graph = frontend.load(_three_projections(tmp_path / "branches.onnx"))
    merged, merges = horizontal_transform(graph)
    assert len(merges) == 2
    kinds = [op.op_type for op in merged.ops]
    assert kinds.count("MatMul") == 1 and kinds.count("Conv") == 1 and kinds.count("Add") == 1
    assert merged.inputs == graph.inputs and merged.outputs == graph.outputs
    rng = np.random.default_rng(2)
    feeds = {t: rng.standard_normal(graph.tensors[t].shape).astype(np.float32)
             for t in graph.inputs}
    for want, got in zip(run_onnxruntime(graph, feeds), run_onnxruntime(merged, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_bert_qkv_projections_become_one_gemm():
    graph = frontend.load(ZOO / "bert-base.onnx")
    plan = partitioner("souffle")(graph, RandomLatencies(0))
    before = sum(op.op_type == "MatMul" for op in graph.ops)
    after = sum(op.op_type == "MatMul" for op in plan.graph.ops)
    layers = sum(d.reason.startswith("horizontal: 3 ") for d in plan.decisions)
    assert layers >= 1 and after == before - 2 * layers


def test_partition_points_are_compute_intensive_and_follow_the_cache():
    graph = frontend.load(ZOO / "bert-base.onnx")
    roomy = Souffle(Resources(cache_bytes=1 << 30, max_ops=1000))(graph, RandomLatencies(0))
    tight = Souffle(Resources(cache_bytes=1))(graph, RandomLatencies(0))
    program = lower_program(tight.graph)
    splits = [d for d in tight.decisions if not d.fused]
    assert splits and all(program.compute_intensive(tight.graph.op_by_id[d.second]) for d in splits)
    assert all(d.reason.startswith("resource") for d in splits)
    opaque = sum(op_info(op.op_type).opaque for op in graph.ops)
    assert roomy.kernels <= 1 + opaque < tight.kernels


def test_the_slices_of_a_merged_projection_are_index_maps_of_their_readers():
    """§6.2: the Q/K/V slices (and the reshapes and transposes after them) move no data of their
    own: they run in the kernel that reads them, which reads the merged result in place (a cache
    of one byte makes every compute-intensive TE a partition point)."""
    graph = frontend.load(ZOO / "bert-base.onnx")
    plan = Souffle(Resources(cache_bytes=1))(graph, RandomLatencies(0))
    g = plan.graph
    slices = [op for op in g.ops if op.op_type == "Slice"]
    assert slices
    for op in slices:
        merged = g.producer(op.inputs[0])
        readers = {plan.block_of[c.id] for c in g.consumers(op.outputs[0])}
        assert readers == {plan.block_of[op.id]}
        assert plan.block_of[merged.id] != plan.block_of[op.id]


def test_an_op_that_mixes_in_other_elements_has_no_map():
    """Pad's border and Concat's second input come from elsewhere: not a reindexing of the input
    (a pad value of 0 must not pass for element 0)."""
    graph = ecg([("Pad", ["a", "pads"], ["b"]), ("Concat", ["a", "c"], ["d"])],
                {"a": (2, 3), "pads": (4,), "b": (2, 5), "c": (2, 3), "d": (4, 3)},
                ["a", "c"], ["b", "d"], constants={"pads": np.array([0, 1, 0, 1])})
    graph.op_by_id["op1"].attrs["axis"] = 0
    program = lower_program(graph)
    assert program.exprs["b"].maps == {"a": None}
    assert program.exprs["d"].maps == {"a": None, "c": None}


def test_rank_zero_maps_fit():
    scalar = fit(np.array([[1, 2]]).reshape(2), (), (3, 4))
    assert scalar.offset == (1, 2) and scalar.apply(()) == (1, 2)
    broadcast_scalar = fit(np.zeros((3, 0), np.int64), (3,), ())  # a scalar read by every element
    assert broadcast_scalar.matrix == () and broadcast_scalar.apply((2,)) == ()
