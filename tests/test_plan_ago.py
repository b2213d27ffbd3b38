"""AGO's weighted clustering (§IV): topological stages, affix sets, acyclic merging, Eq. 1 and its
fitted constants, the weight threshold."""
from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings

from kiln.codegen.intensive import POINTWISE, find_pairs
from kiln.plan import partitioner
from kiln.plan.ago import (
    AGO,
    Clustering,
    Settings,
    Weights,
    cluster,
    default_weights,
    fit_weights,
    loop_extents,
    loop_term,
)
from tests.graphs import ecg
from tests.test_plan import RandomLatencies, block_dag_is_acyclic, conv_chain_graph, random_dags


def fig9_graph():
    """The paper's Fig. 9: Conv1 → ReLU → Conv2 → ReLU → Conv3, and Conv1 → Conv3 directly."""
    shapes = {"x": (1, 4, 8, 8), "w": (4, 4, 1, 1), "c1": (1, 4, 8, 8), "r1": (1, 4, 8, 8),
              "c2": (1, 4, 8, 8), "r2": (1, 4, 8, 8), "s": (1, 4, 8, 8), "c3": (1, 4, 8, 8)}
    ops = [("Conv", ["x", "w"], ["c1"]), ("Relu", ["c1"], ["r1"]), ("Conv", ["r1", "w"], ["c2"]),
           ("Relu", ["c2"], ["r2"]), ("Add", ["r2", "c1"], ["s"]), ("Conv", ["s", "w"], ["c3"])]
    return ecg(ops, shapes, ["x"], ["c3"], {"w": np.ones((4, 4, 1, 1), np.float32)})


def node(state: Clustering, op_id: str) -> int:
    return state.node_of[op_id]


def test_topological_stages_are_longest_paths_and_affix_sets_neighbours_one_stage_apart():
    graph = fig9_graph()
    state = Clustering(graph, {op.id: 1.0 for op in graph.ops})
    assert [state.stage[node(state, f"op{i}")] for i in range(6)] == [1, 2, 3, 4, 5, 6]
    add = node(state, "op4")
    # Conv1 is a neighbour of the Add (it reads c1) but four stages before it: not in its affix set
    assert node(state, "op0") in state.pred[add]
    assert state.affix_set(add) == {node(state, "op3"), node(state, "op5")}
    assert state.affix_set(node(state, "op0")) == {node(state, "op1")}


def test_merging_outside_the_affix_set_is_what_creates_cycles():
    graph = fig9_graph()
    state = Clustering(graph, {op.id: 1.0 for op in graph.ops})
    conv1, relu1, add = node(state, "op0"), node(state, "op1"), node(state, "op4")
    # Fig. 9: Conv1 with the Add (Conv3's side) while the path through Conv2 stays outside
    assert add not in state.affix_set(conv1)
    assert state.creates_cycle(conv1, add)
    assert not state.creates_cycle(conv1, relu1)
    for v in list(state.members):  # Theorem 1: no affix pair closes a cycle
        for u in state.affix_set(v):
            assert not state.creates_cycle(v, u)


def test_stages_follow_the_hyper_node_graph_after_a_merge():
    graph = fig9_graph()
    state = Clustering(graph, {op.id: 1.0 for op in graph.ops})
    merged = state.merge(node(state, "op0"), node(state, "op1"))
    assert state.stage[merged] == 1 and state.stage[node(state, "op2")] == 2
    assert state.stage[node(state, "op4")] == 4  # Add: after Relu2, at 3
    assert state.affix_set(node(state, "op2")) == {merged, node(state, "op3")}


@settings(max_examples=60, deadline=None)
@given(graph=random_dags())
def test_clustering_under_any_threshold_is_acyclic_and_light(graph):
    for threshold in (0.5, 3.0, 1e9):
        weights = Weights(1.0, 1.0, threshold, fitted=False)
        groups = cluster(graph, weights)
        assert sorted(i for g in groups for i in g) == sorted(op.id for op in graph.ops)
        for g in groups:
            if len(g) > 1:
                assert sum(weights.of(loop_term(graph, graph.op_by_id[i])) for i in g) < threshold


@settings(max_examples=40, deadline=None)
@given(graph=random_dags())
def test_an_unbounded_threshold_reaches_a_fixed_point_where_no_affix_pair_is_left(graph):
    groups = cluster(graph, Weights(1.0, 1.0, math.inf, fitted=False))
    state = Clustering(graph, {op.id: 1.0 for op in graph.ops})
    for g in groups:  # replay the final partition
        for i in g[1:]:
            if state.node_of[i] != state.node_of[g[0]]:
                state.merge(state.node_of[g[0]], state.node_of[i])
    assert all(not state.affix_set(v) for v in state.members)  # random graphs: nothing opaque


def test_eq1_loops_of_a_convolution_and_a_matmul():
    graph = conv_chain_graph()
    conv3x3 = graph.op_by_id["op3"]  # w2: (16, 16, 3, 3) on 40×40 → 38×38
    assert loop_extents(graph, conv3x3) == [1, 16, 38, 38, 16, 3, 3]
    assert math.isclose(loop_term(graph, conv3x3),
                        math.log(16) ** 2 * math.log(38) ** 2 * math.log(3) ** 2)
    shapes = {"a": (8, 32), "b": (32, 64), "c": (8, 64)}
    mm = ecg([("MatMul", ["a", "b"], ["c"])], shapes, ["a"], ["c"],
             {"b": np.ones((32, 64), np.float32)})
    assert loop_extents(mm, mm.ops[0]) == [8, 64, 32]


class TunedStore(RandomLatencies):
    """A profile database whose tuner spent `budget(ops)` schedules on each subgraph."""

    def __init__(self, budget):
        super().__init__(0)
        self.budget = budget

    def schedules(self, graph, op_ids):
        return [({"kernel": str(i)}, 1e-3) for i in range(self.budget(graph, op_ids))]


def test_eq1_constants_are_fitted_to_the_tuning_budgets_the_store_recorded():
    graph = conv_chain_graph()
    slope, bias = 0.05, 2.0

    def budget(g, ids):
        return round(sum(slope * loop_term(g, g.op_by_id[i]) + bias for i in ids))

    fitted = fit_weights(graph, TunedStore(budget), [[op.id] for op in graph.ops], Settings())
    assert fitted.fitted
    assert math.isclose(fitted.slope, slope, rel_tol=0.2) and math.isclose(fitted.bias, bias, rel_tol=0.3)
    untuned = fit_weights(graph, RandomLatencies(0), [[op.id] for op in graph.ops], Settings())
    assert not untuned.fitted and (untuned.slope, untuned.bias) == (1.0, 1.0)


def test_the_threshold_grows_with_the_l2_cache():
    class Machine:
        def __init__(self, l2):
            self.l2_bytes = l2

    small, large = RandomLatencies(0), RandomLatencies(0)
    small.machine, large.machine = Machine(256 << 10), Machine(4 << 20)
    assert default_weights(small, Settings()).threshold < default_weights(large, Settings()).threshold


def test_subgraphs_may_hold_several_complex_ops_and_split_keeps_one():
    graph = conv_chain_graph()
    plan = partitioner("ago")(graph, RandomLatencies(0))
    assert block_dag_is_acyclic(plan)
    assert max(sum(graph.op_by_id[i].op_type == "Conv" for i in b.op_ids) for b in plan.blocks) >= 2
    split = AGO(Settings(max_complex=1))(graph, RandomLatencies(0))
    assert all(sum(graph.op_by_id[i].op_type == "Conv" for i in b.op_ids) <= 1 for b in split.blocks)


def bert_like_ffn(seq: int, hidden: int, inner: int):
    """A transformer FFN as BERT's exporter writes it: MatMul + bias, GELU (erf), MatMul + bias,
    residual."""
    shapes = {t: (1, seq, inner) for t in ("m1", "a1", "d", "e", "e1", "g0", "g")}
    shapes.update({t: (1, seq, hidden) for t in ("x", "m2", "a2", "y")})
    rng = np.random.default_rng(0)
    constants = {"w1": rng.standard_normal((hidden, inner)).astype(np.float32),
                 "b1": rng.standard_normal(inner).astype(np.float32),
                 "w2": rng.standard_normal((inner, hidden)).astype(np.float32),
                 "b2": rng.standard_normal(hidden).astype(np.float32),
                 "sq": np.array(1.4142135, np.float32), "one": np.array(1, np.float32),
                 "half": np.array(0.5, np.float32)}
    shapes.update({k: v.shape for k, v in constants.items()})
    ops = [("MatMul", ["x", "w1"], ["m1"]), ("Add", ["m1", "b1"], ["a1"]), ("Div", ["a1", "sq"], ["d"]),
           ("Erf", ["d"], ["e"]), ("Add", ["e", "one"], ["e1"]), ("Mul", ["a1", "e1"], ["g0"]),
           ("Mul", ["g0", "half"], ["g"]), ("MatMul", ["g", "w2"], ["m2"]), ("Add", ["m2", "b2"], ["a2"]),
           ("Add", ["a2", "x"], ["y"])]
    return ecg(ops, shapes, ["x"], ["y"], constants)


def test_a_bert_like_ffn_is_one_subgraph_whose_matmuls_are_an_intensive_pair():
    class Machine:
        l2_bytes = 1 << 20

    store = RandomLatencies(0)
    store.machine = Machine()
    graph = bert_like_ffn(64, 256, 1024)  # BERT-small's sizes: under the 1 MiB L2's threshold
    plan = partitioner("ago")(graph, store)
    matmuls = {op.id for op in graph.ops if op.op_type == "MatMul"}
    block = next(b for b in plan.blocks if matmuls <= set(b.op_ids))
    pairs = find_pairs(graph, [graph.op_by_id[i] for i in block.op_ids], set(block.outputs),
                       set(graph.outputs))
    (pair,) = pairs.values()
    assert {pair.up.id, pair.down.id} == matmuls and pair.rows and pair.category == POINTWISE
    assert [op.op_type for op in pair.between] == ["Add", "Div", "Erf", "Add", "Mul", "Mul"]
