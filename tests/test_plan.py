"""Fusion planning: legality, acyclicity on random DAGs, the baselines, and DNNFusion's choices."""
from __future__ import annotations

import random
from pathlib import Path
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kiln.ecg import Graph, Op, Tensor
from kiln.mapping import MappingType as M
from kiln.plan import FusionPlan, partitioner, partitioner_names
from kiln.plan.dnnfusion import Constraints, DNNFusion
from kiln.profile import COST_MODEL, Estimate
from tests.graphs import ecg

TYPE_FOR = {M.ONE_TO_ONE: "Relu", M.REORGANIZE: "Reshape", M.SHUFFLE: "Transpose",
            M.ONE_TO_MANY: "Expand", M.MANY_TO_MANY: "Softmax"}


class RandomLatencies:
    """Arbitrary (but repeatable) latency answers: plans must be valid whatever the store says."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.answers: dict[tuple[str, ...], float] = {}

    def latency(self, graph, op_ids):
        key = tuple(op_ids)
        if key not in self.answers:
            self.answers[key] = self.rng.uniform(1e-6, 1e-3)
        return Estimate(self.answers[key], COST_MODEL)

    fallback = None

    def record(self, graph, op_ids, seconds, source="measured", schedule=None, toolchain=""):
        raise NotImplementedError

    def schedules(self, graph, op_ids):
        return []


@st.composite
def random_dags(draw):
    n = draw(st.integers(2, 40))
    tensors = {"x": Tensor("x", (4, 4), "float32")}
    ops = []
    for i in range(n):
        available = ["x"] + [op.outputs[0] for op in ops]
        k = draw(st.integers(1, min(3, len(available))))
        inputs = tuple(draw(st.lists(st.sampled_from(available), min_size=k, max_size=k)))
        mapping = draw(st.sampled_from(list(M)))
        op_type = TYPE_FOR[mapping] if len(inputs) == 1 else "Add"
        out = f"t{i}"
        tensors[out] = Tensor(out, (4, 4), "float32")
        ops.append(Op(f"op{i}", op_type, inputs, (out,), mapping=mapping,
                      compute_intensive=mapping == M.MANY_TO_MANY and draw(st.booleans())))
    consumed = {t for op in ops for t in op.inputs}
    outputs = [op.outputs[0] for op in ops if op.outputs[0] not in consumed]
    return Graph(tensors, ops, ["x"], outputs)


def block_dag_is_acyclic(plan: FusionPlan) -> bool:
    graph = plan.graph
    edges = {b.id: set() for b in plan.blocks}
    for op in graph.ops:
        for pred in graph.predecessors(op):
            a, b = plan.block_of[pred.id], plan.block_of[op.id]
            if a != b:
                edges[a].add(b)
    state: dict[str, int] = {}

    def visit(node: str) -> bool:  # True if a cycle is reachable
        state[node] = 1
        for nxt in edges[node]:
            if state.get(nxt) == 1 or (nxt not in state and visit(nxt)):
                return True
        state[node] = 2
        return False

    return not any(node not in state and visit(node) for node in edges)


@settings(max_examples=150, deadline=None)
@given(graph=random_dags(), seed=st.integers(0, 1000))
def test_every_partitioner_makes_acyclic_complete_plans(graph, seed):
    for name in partitioner_names():  # a new partitioner is checked as soon as it registers
        plan = partitioner(name)(graph, RandomLatencies(seed))
        members = [op_id for b in plan.blocks for op_id in b.op_ids]
        assert sorted(members) == sorted(op.id for op in graph.ops)
        assert block_dag_is_acyclic(plan)
        position = {b.id: i for i, b in enumerate(plan.blocks)}
        for op in graph.ops:  # blocks are listed in an executable order
            for pred in graph.predecessors(op):
                assert position[plan.block_of[pred.id]] <= position[plan.block_of[op.id]]


@settings(max_examples=100, deadline=None)
@given(graph=random_dags(), seed=st.integers(0, 1000))
def test_without_relaxation_dnnfusion_never_fuses_red_pairs(graph, seed):
    plan = DNNFusion(Constraints(relax_red=False))(graph, RandomLatencies(seed))
    for block in plan.blocks:
        ops = [graph.op_by_id[i] for i in block.op_ids]
        assert sum(op.mapping == M.MANY_TO_MANY for op in ops) <= 1
        for edge in block.edges:
            producer = graph.op_by_id[edge.producer]
            consumer = graph.op_by_id[edge.consumer]
            assert not (producer.mapping == M.ONE_TO_MANY and consumer.mapping == M.MANY_TO_MANY)


def test_an_epilogue_is_not_moved_into_a_block_that_a_third_block_makes_it_wait_for():
    """Found by the property test above: Softmax op2 (a contraction's block, with op7) feeds
    Relu op6, whose block also adds it to op4's result. op4 reads op3, which sits in the block of
    op9, a reader of op7: op4 depends on op2's block through a block (op3, op9, op10), not through
    any path of ops. Moving op6 and op13 into op2's block as its epilogue made the blocks wait on
    each other in a cycle."""
    spec = [("Relu", ["x"]), ("Relu", ["x"]), ("Softmax", ["x"]), ("Reshape", ["x"]),
            ("Reshape", ["t3"]), ("Relu", ["x"]), ("Relu", ["t2"]), ("Reshape", ["t2"]),
            ("Softmax", ["t6"]), ("Expand", ["t7"]), ("Add", ["t3", "t9"]), ("Reshape", ["t6"]),
            ("Relu", ["x"]), ("Add", ["t4", "t6"])]
    mapping = {op_type: m for m, op_type in TYPE_FOR.items()} | {"Add": M.ONE_TO_ONE}
    tensors = {f"t{i}": Tensor(f"t{i}", (4, 4), "float32") for i in range(len(spec))}
    tensors["x"] = Tensor("x", (4, 4), "float32")
    ops = [Op(f"op{i}", op_type, tuple(inputs), (f"t{i}",), mapping=mapping[op_type],
              compute_intensive=i == 2) for i, (op_type, inputs) in enumerate(spec)]
    consumed = {t for op in ops for t in op.inputs}
    graph = Graph(tensors, ops, ["x"], [op.outputs[0] for op in ops if op.outputs[0] not in consumed])
    plan = DNNFusion(Constraints(relax_red=False))(graph, RandomLatencies(0))
    assert block_dag_is_acyclic(plan)
    assert plan.block_of["op13"] != plan.block_of["op2"]


@settings(max_examples=100, deadline=None)
@given(graph=random_dags(), seed=st.integers(0, 1000))
def test_red_pairs_fuse_only_through_a_named_relaxation(graph, seed):
    plan = partitioner("dnnfusion")(graph, RandomLatencies(seed))
    allowed = {"green", "yellow", "yellow: tiny intermediate", "yellow: row-local ops over the same rows",
               "green: epilogue rather than prologue", "attention chain"}
    # a yellow verdict says in parentheses what it rested on (measured, cost-model, ...)
    assert {d.reason.split(" (")[0] for d in plan.decisions if d.fused} <= allowed


def _relaxation_graph(rows: int):
    """Softmax(MatMul(x, W)) over `rows` rows: both ops are row-local over the same rows."""
    shapes = {"x": (rows, 64), "w": (64, 64), "h": (rows, 64), "y": (rows, 64)}
    constants = {"w": np.ones((64, 64), np.float32)}
    return ecg([("MatMul", ["x", "w"], ["h"]), ("Softmax", ["h"], ["y"])], shapes, ["x"], ["y"], constants)


def test_row_local_many_to_many_ops_fuse_and_the_paper_mode_refuses():
    graph = _relaxation_graph(rows=512)
    store = RandomLatencies(0)
    assert partitioner("dnnfusion")(graph, store).kernels == 1
    assert DNNFusion(Constraints(relax_red=False))(graph, store).kernels == 2


def test_an_attention_chain_stays_in_one_block():
    """QKᵀ → scale → Softmax → ·V with Q, K and V projected from one input: the chain is one
    block whatever the store says (its second MatMul is not taken by the block that projects V,
    as a prologue)."""
    shapes = {"x": (16, 32), "wq": (32, 8), "wk": (32, 8), "wv": (32, 8), "c": (),
              "q": (16, 8), "k": (16, 8), "kt": (8, 16), "v": (16, 8), "s": (16, 16),
              "sc": (16, 16), "p": (16, 16), "o": (16, 8)}
    constants = {w: np.ones((32, 8), np.float32) for w in ("wq", "wk", "wv")}
    constants["c"] = np.array(0.5, np.float32)
    graph = ecg([("MatMul", ["x", "wq"], ["q"]), ("MatMul", ["x", "wk"], ["k"]),
                 ("MatMul", ["x", "wv"], ["v"]), ("Transpose", ["k"], ["kt"]),
                 ("MatMul", ["q", "kt"], ["s"]), ("Mul", ["s", "c"], ["sc"]),
                 ("Softmax", ["sc"], ["p"]), ("MatMul", ["p", "v"], ["o"])],
                shapes, ["x"], ["o"], constants)
    chain = ("op4", "op5", "op6", "op7")
    for store in (RandomLatencies(0), RandomLatencies(1)):
        plan = partitioner("dnnfusion")(graph, store)
        block = next(b for b in plan.blocks if "op6" in b.op_ids)
        assert set(chain) <= set(block.op_ids)
        assert [d.second for d in plan.decisions if d.reason == "attention chain"] == ["op5", "op6",
                                                                                      "op7"]


def test_row_tiles_must_keep_their_operands_in_cache():
    graph = _relaxation_graph(rows=512)
    small_cache = DNNFusion(Constraints(tile_operand_bytes=8 * 1024, tiny_bytes=0))
    assert small_cache(graph, RandomLatencies(0)).kernels == 2


def bias_gelu_graph():
    """MatMul → Add(bias) → GELU (erf form) → MatMul: the BERT feed-forward shape."""
    shapes = {"x": (1, 8, 16), "w1": (16, 32), "b1": (32,), "h": (1, 8, 32), "hb": (1, 8, 32),
              "c": (), "d": (1, 8, 32), "e": (1, 8, 32), "one": (), "f": (1, 8, 32),
              "half": (), "g": (1, 8, 32), "y": (1, 8, 32), "w2": (32, 16), "z": (1, 8, 16)}
    constants = {name: np.ones(shapes[name], np.float32) for name in ("w1", "b1", "c", "one", "half", "w2")}
    ops = [("MatMul", ["x", "w1"], ["h"]), ("Add", ["h", "b1"], ["hb"]), ("Div", ["hb", "c"], ["d"]),
           ("Erf", ["d"], ["e"]), ("Add", ["e", "one"], ["f"]), ("Mul", ["hb", "f"], ["g"]),
           ("Mul", ["g", "half"], ["y"]), ("MatMul", ["y", "w2"], ["z"])]
    return ecg(ops, shapes, ["x"], ["z"], constants)


def test_dnnfusion_grows_from_the_seed_as_listing_1_does():
    # Seed: Add(bias), the first One-to-One op with the smallest result. Successors come first, so the
    # GELU chain joins the second MatMul as its prologue (O2O + M2M is green, as Add + Conv in the
    # paper's Figure 3); the first MatMul is then refused (M2M + M2M is red) and stays alone.
    graph = bias_gelu_graph()
    plan = DNNFusion(Constraints(relax_red=False, prefer_epilogues=False))(graph, RandomLatencies(0))
    assert plan.kernels == 2
    first, second = plan.blocks
    assert first.op_ids == ("op0",)
    assert [graph.op_by_id[i].op_type for i in second.op_ids] == ["Add", "Div", "Erf", "Add", "Mul", "Mul", "MatMul"]
    assert second.anchor == "op7" and second.mapping == M.MANY_TO_MANY
    assert second.name == "fused_add_div_erf_mul_matmul"
    assert second.inputs[0] == "h" and second.outputs == ("z",)
    assert [op.ir_removable for op in plan.graph.ops] == [False] + [True] * 6 + [False]
    refused = [d for d in plan.decisions if d.second == "op0" and not d.fused]
    assert refused and refused[0].reason == "red: Many-to-Many + Many-to-Many"
    # Both MatMuls are row-local over the same 8 rows with small weights: the relaxed mode fuses them.
    relaxed = partitioner("dnnfusion")(graph, RandomLatencies(0))
    assert relaxed.kernels == 1
    assert [d.reason for d in relaxed.decisions if d.second == "op0"] == [
        "yellow: row-local ops over the same rows (cost-model)"]


def conv_chain_graph(outputs=("y",)):
    """Conv 1×1 → SiLU (Sigmoid, Mul) → Conv 3×3 → Relu → Conv 1×1: a MobileNet/EfficientNet block."""
    shapes = {"x": (1, 8, 40, 40), "w1": (16, 8, 1, 1), "h1": (1, 16, 40, 40), "s1": (1, 16, 40, 40),
              "a1": (1, 16, 40, 40), "w2": (16, 16, 3, 3), "h2": (1, 16, 38, 38), "r2": (1, 16, 38, 38),
              "w3": (8, 16, 1, 1), "y": (1, 8, 38, 38)}  # intermediates above `tiny_bytes`
    constants = {w: np.ones(shapes[w], np.float32) for w in ("w1", "w2", "w3")}
    ops = [("Conv", ["x", "w1"], ["h1"]), ("Sigmoid", ["h1"], ["s1"]), ("Mul", ["h1", "s1"], ["a1"]),
           ("Conv", ["a1", "w2"], ["h2"]), ("Relu", ["h2"], ["r2"]), ("Conv", ["r2", "w3"], ["y"])]
    return ecg(ops, shapes, ["x"], list(outputs), constants)


def op_types(plan: FusionPlan) -> list[list[str]]:
    return [[plan.graph.op_by_id[i].op_type for i in b.op_ids] for b in plan.blocks]


def test_activations_end_the_contraction_before_them_rather_than_start_the_next():
    graph = conv_chain_graph()
    listing = DNNFusion(Constraints(prefer_epilogues=False))(graph, RandomLatencies(0))
    # Listing 1 alone: the activation seeds grow successors first and become prologues.
    assert op_types(listing) == [["Conv"], ["Sigmoid", "Mul", "Conv"], ["Relu", "Conv"]]
    plan = partitioner("dnnfusion")(graph, RandomLatencies(0))
    assert op_types(plan) == [["Conv", "Sigmoid", "Mul"], ["Conv", "Relu"], ["Conv"]]
    moved = [d.second for d in plan.decisions if d.reason == "green: epilogue rather than prologue"]
    assert sorted(moved) == ["op1", "op2", "op4"]


def test_a_contraction_result_read_elsewhere_keeps_its_prologue():
    # h1 is also a model output, so the first Conv's block must write it and moving SiLU saves
    # nothing; the Relu still moves.
    plan = partitioner("dnnfusion")(conv_chain_graph(outputs=("y", "h1")), RandomLatencies(0))
    assert op_types(plan) == [["Conv"], ["Sigmoid", "Mul", "Conv", "Relu"], ["Conv"]]


def test_a_residual_add_of_two_convolutions_ends_the_later_one():
    # ResNet's downsampling block: y = Relu(Conv_a(x) + Conv_b(x)) feeding a 1×1 Conv.
    shapes = {"x": (1, 8, 40, 40), "wa": (16, 8, 1, 1), "wb": (16, 8, 1, 1), "wc": (8, 16, 1, 1),
              "a": (1, 16, 40, 40), "b": (1, 16, 40, 40), "s": (1, 16, 40, 40), "r": (1, 16, 40, 40),
              "y": (1, 8, 40, 40)}
    constants = {w: np.ones(shapes[w], np.float32) for w in ("wa", "wb", "wc")}
    graph = ecg([("Conv", ["x", "wa"], ["a"]), ("Conv", ["x", "wb"], ["b"]), ("Add", ["a", "b"], ["s"]),
                 ("Relu", ["s"], ["r"]), ("Conv", ["r", "wc"], ["y"])], shapes, ["x"], ["y"], constants)
    assert op_types(DNNFusion(Constraints(prefer_epilogues=False))(graph, RandomLatencies(0))) == [
        ["Conv"], ["Conv"], ["Add", "Relu", "Conv"]]
    plan = partitioner("dnnfusion")(graph, RandomLatencies(0))
    assert op_types(plan) == [["Conv"], ["Conv", "Add", "Relu"], ["Conv"]]
    assert block_dag_is_acyclic(plan)


def gemm_reshape_gelu_graph():
    """GPT-2's feed-forward: Gemm → Reshape → GELU (tanh) → Reshape → Gemm, the Gemms on 2-D views
    of a [1, 8, C] sequence."""
    shapes = {"x": (8, 16), "w1": (16, 32), "h": (8, 32), "s3": (3,), "h3": (1, 8, 32),
              "g": (1, 8, 32), "s2": (2,), "g2": (8, 32), "w2": (32, 16), "z": (8, 16)}
    constants = {"w1": np.ones((16, 32), np.float32), "w2": np.ones((32, 16), np.float32),
                 "s3": np.array([1, 8, 32], np.int64), "s2": np.array([8, 32], np.int64)}
    ops = [("Gemm", ["x", "w1"], ["h"]), ("Reshape", ["h", "s3"], ["h3"]), ("Gelu", ["h3"], ["g"]),
           ("Reshape", ["g", "s2"], ["g2"]), ("Gemm", ["g2", "w2"], ["z"])]
    return ecg(ops, shapes, ["x"], ["z"], constants)


def test_a_view_between_a_contraction_and_its_activation_moves_with_the_activation():
    graph = gemm_reshape_gelu_graph()  # small enough for row tiles: keep the Gemms apart
    listing = DNNFusion(Constraints(relax_red=False, prefer_epilogues=False))(graph, RandomLatencies(0))
    assert op_types(listing) == [["Gemm"], ["Reshape", "Gelu", "Reshape", "Gemm"]]
    # The Reshape in front carries GELU to the first Gemm's epilogue; the one after GELU is the
    # second Gemm's view of its A operand and stays there.
    plan = DNNFusion(Constraints(relax_red=False))(graph, RandomLatencies(0))
    assert op_types(plan) == [["Gemm", "Reshape", "Gelu"], ["Reshape", "Gemm"]]
    moved = [d.second for d in plan.decisions if d.reason == "green: epilogue rather than prologue"]
    assert sorted(moved) == ["op1", "op2"]


def test_a_view_alone_stays_where_it_is_read():
    # Gemm → Reshape → Softmax: the Reshape carries no One-to-One op, so no block changes.
    shapes = {"x": (8, 16), "w1": (16, 32), "h": (8, 32), "s3": (3,), "h3": (1, 8, 32),
              "y": (1, 8, 32)}
    constants = {"w1": np.ones((16, 32), np.float32), "s3": np.array([1, 8, 32], np.int64)}
    graph = ecg([("Gemm", ["x", "w1"], ["h"]), ("Reshape", ["h", "s3"], ["h3"]),
                 ("Softmax", ["h3"], ["y"])], shapes, ["x"], ["y"], constants)
    listing = DNNFusion(Constraints(prefer_epilogues=False))(graph, RandomLatencies(0))
    assert op_types(partitioner("dnnfusion")(graph, RandomLatencies(0))) == op_types(listing)


def test_baselines_on_the_feed_forward_graph():
    graph = bias_gelu_graph()
    assert partitioner("none")(graph, RandomLatencies(0)).kernels == 8
    fixed = partitioner("fixed")(graph, RandomLatencies(0))
    # MatMul's epilogue stops after Add(bias), whose output has two consumers (Div and Mul); the
    # GELU chain is its own group; the second MatMul's output is the model's output.
    assert [len(b.op_ids) for b in fixed.blocks] == [2, 5, 1]


def test_fusing_across_a_side_path_would_be_a_cycle():
    # a = Softmax(x); b = Softmax(a); c = Add(a, b). The seed Add may not take `a` while `b` is
    # outside its block: a → b → Add would leave and re-enter the block.
    shapes = {n: (2, 3) for n in ("x", "a", "b", "c")}
    graph = ecg([("Softmax", ["x"], ["a"]), ("Softmax", ["a"], ["b"]), ("Add", ["a", "b"], ["c"])],
                shapes, ["x"], ["c"])
    plan = DNNFusion(Constraints(relax_red=False))(graph, RandomLatencies(1))
    assert block_dag_is_acyclic(plan)
    assert [b.op_ids for b in plan.blocks] == [("op0",), ("op1", "op2")]
    assert [d.reason for d in plan.decisions if d.second == "op0"][0] == "illegal: would create a cycle"


def test_constraints_bound_block_size():
    n = 60
    shapes = {f"t{i}": (4,) for i in range(n + 1)}
    graph = ecg([("Relu", [f"t{i}"], [f"t{i+1}"]) for i in range(n)], shapes, ["t0"], [f"t{n}"])
    plan = partitioner("dnnfusion")(graph, RandomLatencies(0))
    assert max(len(b.op_ids) for b in plan.blocks) <= 48
    assert any(d.reason.startswith("constraint") for d in plan.decisions)


def test_yellow_cases_follow_the_store():
    # Softmax (M2M) → Reshape (REO) is yellow: fused only if the store says it is faster.
    shapes = {"x": (2, 6), "s": (2, 6), "shape": (2,), "r": (3, 4)}
    constants = {"shape": np.array([3, 4], np.int64)}
    graph = ecg([("Softmax", ["x"], ["s"]), ("Reshape", ["s", "shape"], ["r"])], shapes, ["x"], ["r"], constants)

    class Store(RandomLatencies):
        def __init__(self, fused_cost):
            super().__init__(0)
            self.fused_cost = fused_cost

        def latency(self, graph, op_ids):
            return Estimate(self.fused_cost if len(op_ids) == 2 else 1.0, COST_MODEL)

    assert len(partitioner("dnnfusion")(graph, Store(1.5)).blocks) == 1
    slower = partitioner("dnnfusion")(graph, Store(2.5))
    assert len(slower.blocks) == 2 and slower.yellow_lookups == 1
    assert any(d.reason == "yellow: slower fused (cost-model)" for d in slower.decisions)


def test_a_block_of_reorganize_ops_is_a_view_not_a_kernel():
    shapes = {"x": (2, 3, 4), "shape": (2,), "r": (6, 4), "y": (6, 4)}
    constants = {"shape": np.array([6, 4], np.int64)}
    graph = ecg([("Reshape", ["x", "shape"], ["r"]), ("Softmax", ["r"], ["y"])], shapes, ["x"], ["y"], constants)
    plan = partitioner("none")(graph, RandomLatencies(0))
    assert [b.is_view for b in plan.blocks] == [True, False]
    assert len(plan.blocks) == 2 and plan.kernels == 1


def test_stacked_recurrent_layers_share_a_kernel():
    from kiln import frontend
    graph = frontend.load(Path(__file__).parent / "fixtures" / "zoo" / "lstm.onnx")
    assert [op.op_type for op in graph.ops] == ["LSTM", "Squeeze", "LSTM", "Squeeze"]
    stacked = partitioner("dnnfusion")(graph, RandomLatencies(0))
    assert stacked.kernels == 1 and len(stacked.blocks) == 1
    assert "yellow: stacked recurrent layers" in {d.reason.split(" (")[0]
                                                  for d in stacked.decisions if d.fused}
    paper = DNNFusion(Constraints(relax_red=False))(graph, RandomLatencies(0))
    assert paper.kernels == 2  # each LSTM alone; the Squeezes are views


class MeasuredLatencies:
    """Measured answers: the fused kernel (two ops) and each op alone, with p10/p90 spreads;
    its fallback, a cost model, always finds fusing faster."""

    def __init__(self, together: tuple[float, float, float], alone: tuple[float, float, float]):
        self.together, self.alone = together, alone
        self.fallback = FusingCostModel()

    def latency(self, graph, op_ids):
        median, p10, p90 = self.together if len(op_ids) > 1 else self.alone
        return Estimate(median, "measured", p10, p90)

    def record(self, *args, **kwargs):
        raise NotImplementedError

    def schedules(self, graph, op_ids):
        return []


class FusingCostModel:
    fallback = None

    def latency(self, graph, op_ids):
        return Estimate(1e-6, COST_MODEL)


@pytest.mark.parametrize("together, alone, fused, basis", [
    # medians say slower fused (10 > 4 + 4), but the spreads overlap: noise, the model decides
    ((10e-6, 3e-6, 40e-6), (4e-6, 2e-6, 9e-6), True, "cost-model: measurements within noise"),
    ((30e-6, 28e-6, 33e-6), (4e-6, 3e-6, 5e-6), False, "measured"),  # clearly slower
    ((5e-6, 4e-6, 6e-6), (4e-6, 3.5e-6, 4.5e-6), True, "measured"),  # clearly faster
])
def test_measured_yellow_verdicts_count_only_when_they_exceed_their_spread(together, alone,
                                                                            fused, basis):
    graph = _relaxation_graph(rows=512)
    plan = partitioner("dnnfusion")(graph, MeasuredLatencies(together, alone))
    assert plan.kernels == (1 if fused else 2)
    [decision] = [d for d in plan.decisions if d.reason.startswith("yellow")]
    assert decision.fused is fused and decision.reason.endswith(f"({basis})")


def test_dnnfusion_constraints_come_from_the_targets_device():
    """CPU targets keep the x86 constants; an OpenCL target's come from a mobile GPU's limits
    (registers per work-item, local memory)."""
    from kiln.plan import for_target
    from kiln.plan.dnnfusion import Constraints, DNNFusion
    from kiln.target import target

    assert for_target(DNNFusion(), target("x86_64")).constraints == Constraints()
    gpu = for_target(DNNFusion(), target("opencl")).constraints
    limits = target("opencl").limits
    assert gpu.max_live_values == limits.registers > Constraints().max_live_values
    assert gpu.tiny_bytes == limits.fast_memory_bytes // 2
    assert gpu.tile_operand_bytes == limits.shared_cache_bytes
