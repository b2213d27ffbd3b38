"""Partitioner `ago`: AGO's weighted clustering into arbitrary-structure subgraphs (§IV).

The algorithm is the paper's CLUSTER (Algorithm 1):

* every op gets a weight by Eq. 1, w_v = c · ∏_{l ∈ L_v} ln(s_l) + b, over the loops L_v of its
  loop nest (the dims of its output, plus its reduction loops: input channels and kernel taps of
  a convolution, K of a matrix product, the reduced extent of a reduction); a subgraph weighs the
  sum of its ops (the paper's second observation, Fig. 8);
* every op starts as a hyper node in the candidate set; repeatedly the heaviest candidate v
  merges with the lightest node u of its *affix set* — the neighbours whose topological stage
  (longest path from a root) differs from v's by exactly one — if w_v + w_u < Td; otherwise v
  leaves the candidate set. Stages are recomputed on the graph of hyper nodes after every merge
  and the loop runs until the candidate set is empty. A merge changes stages around the new
  hyper node, so its neighbours re-enter the candidate set: the loop ends at a fixed point where
  no node has an affix node it can merge with under the threshold.
  Theorem 1: a path from u to v through a third node p would need ts_v ≥ ts_u + 2, so merging
  affix nodes never closes a cycle among subgraphs (`affix_set`, `creates_cycle` test it).

Nothing restricts a subgraph's structure: chains, diamonds and several complex ops in one
subgraph are all allowed; the weight threshold alone bounds its size. The code generator lowers a
subgraph with several Many-to-Many ops as a sequence of stages in one kernel (joint optimisation)
and fuses the pairs the paper's §III allows (conv → depthwise conv, conv → pointwise conv, and a
MatMul/Gemm → MatMul/Gemm, the pointwise category over rows) tile by tile through a cache-resident
buffer (`kiln.codegen.intensive`, `kiln.codegen.intensive_rows`). The planner proposes such pairs
by the same rule as every other merge: both ops and the ops between land in one subgraph when
their weights stay under Td. A transformer FFN passes it when its loops are small enough for the
target's L2: MobileBERT's (128 × 128 → 512) weighs about 350 under a 1 MiB L2's Td ≈ 614, while
BERT-base's (128 × 768 → 3072, with GELU's four ops between) weighs about 760 and is cut.

From mobile GPUs/CPUs with a TVM tuner to Kiln's CPU code generator:

* **Eq. 1's constants c and b** are the paper's fit of tuning budget (schedules explored until
  the performance is stable) against ∏ ln(s_l). Kiln fits the same line on the target's own
  profile database: for every op and every subgraph of a first clustering that the tuner has
  measured (≥ 2 schedules recorded for it on this machine, `ProfileStore.schedules`), the number
  of schedules recorded is the budget the tuner spent on it (the full tuner stops when a
  generation brings nothing new: the paper's "stable"), regressed by least squares on
  (Σ ∏ ln s_l, number of ops). With fewer than `min_fit_points` such subgraphs (a fresh
  database, or a cost model such as the roofline store, which records no schedules), the
  defaults c = 1 (one unit of weight per unit of the loop-nest term) and b = 1 (every op costs
  at least one unit, so a subgraph's weight also grows with its number of ops) apply.
* **The threshold Td** comes from the target's cache sizes instead of a tuning budget chosen by
  hand: Td = `complex_ops` × the weight of the largest float32 matrix product whose three
  operands fit in the L2 together (n = √(L2 / 12) per side, loops n × n × n). A subgraph may be
  as hard to tune as that many L2-resident complex ops: an inverted residual block's expansion
  and depthwise convolutions with their activations fit; whole stages of a network do not. The
  L2 size is the store's machine facts (`store.machine`), else this machine's (`kiln.cpuinfo`).
* **Opaque ops** (control flow, data-dependent shapes) and **recurrent ops** stay alone: Kiln's
  code generator gives them their own kernel, which the paper's TVM frontend does too.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kiln.cpuinfo import host_caches
from kiln.ecg import Graph, Op
from kiln.mapping import MappingType
from kiln.ops import RowLocality, op_info
from kiln.plan import Decision, FusionPlan, register_partitioner
from kiln.plan.blocks import build_plan
from kiln.profile import ProfileStore

DEFAULT_L2_BYTES = 1 << 20


@dataclass(frozen=True)
class Settings:
    complex_ops: int = 4  # Td = this many L2-resident matrix products' weight
    slope: float = 1.0  # Eq. 1's c and b when the profile database cannot fit them
    bias: float = 1.0
    min_fit_points: int = 3
    max_complex: int | None = None  # at most this many complex ops per subgraph (SPLIT uses 1)


@dataclass(frozen=True)
class Weights:
    """Eq. 1 with fitted constants, and the threshold in the same units."""

    slope: float
    bias: float
    threshold: float
    fitted: bool  # from the profile database's tuning budgets, or the defaults

    def of(self, loop_term: float) -> float:
        return self.slope * loop_term + self.bias


# --- Eq. 1 ------------------------------------------------------------------------------------------
def loop_extents(graph: Graph, op: Op) -> list[int]:
    """The extents of the loops of `op`'s loop nest: its largest output's dims, then its
    reduction loops."""
    outs = [graph.tensors[t].shape for t in op.outputs if t in graph.tensors]
    out_shape = max(outs, key=math.prod, default=())
    inputs = [graph.tensors[t].shape for t in op.present_inputs() if t in graph.tensors]
    reduction: Sequence[int] = ()
    if op.mapping == MappingType.MANY_TO_MANY and inputs:
        if op_info(op.op_type).row_locality is RowLocality.MATRIX_ROWS and inputs[0]:
            reduction = (inputs[0][-1],)
        elif op.compute_intensive and len(inputs) > 1 and len(inputs[1]) == len(out_shape) >= 3:
            reduction = inputs[1][1:]  # a convolution's weight: input channels and taps
        else:
            reduction = (max(1, math.prod(inputs[0]) // max(1, math.prod(out_shape))),)
    return [int(s) for s in (*out_shape, *reduction)]


def loop_term(graph: Graph, op: Op) -> float:
    """∏ ln(s_l) over the op's loops of more than one iteration (a loop of one is no loop)."""
    return math.prod(math.log(s) for s in loop_extents(graph, op) if s > 1)


def l2_bytes(store: ProfileStore) -> int:
    machine = getattr(store, "machine", None) or getattr(getattr(store, "fallback", None),
                                                         "machine", None)
    size = getattr(machine, "l2_bytes", None) or host_caches().get("l2_bytes")
    return int(size or DEFAULT_L2_BYTES)


def threshold_term(l2: int) -> float:
    """Eq. 1's loop term of the largest float32 n × n × n matrix product with A, B and C in L2."""
    n = max(2, math.isqrt(l2 // 12))
    return math.log(n) ** 3


def default_weights(store: ProfileStore, settings: Settings) -> Weights:
    return _weights(settings.slope, settings.bias, store, settings, fitted=False)


def _weights(slope: float, bias: float, store: ProfileStore, settings: Settings,
             fitted: bool) -> Weights:
    reference = slope * threshold_term(l2_bytes(store)) + bias
    return Weights(slope, bias, settings.complex_ops * reference, fitted)


def fit_weights(graph: Graph, store: ProfileStore, subgraphs: Iterable[Sequence[str]],
                settings: Settings) -> Weights:
    """c and b of Eq. 1 by least squares on the tuning budgets the store recorded (see the
    module docstring), or the defaults when too few subgraphs were tuned."""
    rows, budgets = [], []
    for ids in subgraphs:
        tuned = len(store.schedules(graph, list(ids)))
        if tuned >= 2:
            rows.append((sum(loop_term(graph, graph.op_by_id[i]) for i in ids), len(ids)))
            budgets.append(tuned)
    if len(rows) >= settings.min_fit_points and len(set(rows)) >= 2:
        (slope, bias), *_ = np.linalg.lstsq(np.array(rows, float), np.array(budgets, float),
                                            rcond=None)
        if slope > 0 and bias >= 0:
            return _weights(float(slope), float(bias), store, settings, fitted=True)
    return default_weights(store, settings)


# --- topological stages and affix sets ----------------------------------------------------------
class Clustering:
    """Hyper nodes (sets of ops) over a graph, with their DAG, weights and topological stages."""

    def __init__(self, graph: Graph, weight: Mapping[str, float]):
        self.graph = graph
        self.node_of: dict[str, int] = {op.id: i for i, op in enumerate(graph.ops)}
        self.members: dict[int, list[str]] = {i: [op.id] for i, op in enumerate(graph.ops)}
        self.weight: dict[int, float] = {i: weight[op.id] for i, op in enumerate(graph.ops)}
        self.succ: dict[int, set[int]] = {i: set() for i in self.members}
        self.pred: dict[int, set[int]] = {i: set() for i in self.members}
        for op in graph.ops:
            for p in graph.predecessors(op):
                a, b = self.node_of[p.id], self.node_of[op.id]
                if a != b:
                    self.succ[a].add(b)
                    self.pred[b].add(a)
        self.stage: dict[int, int] = {}
        self.update_stages()

    def update_stages(self) -> None:
        """ts_v: the length of the longest path from a root to v, roots at 1 (Definition 2)."""
        indegree = {v: len(self.pred[v]) for v in self.members}
        ready = [v for v, d in indegree.items() if d == 0]
        stage = {v: 1 for v in ready}
        while ready:
            v = ready.pop()
            for w in self.succ[v]:
                stage[w] = max(stage.get(w, 1), stage[v] + 1)
                indegree[w] -= 1
                if indegree[w] == 0:
                    ready.append(w)
        if len(stage) != len(self.members):
            raise AssertionError("the graph of hyper nodes has a cycle")
        self.stage = stage

    def affix_set(self, v: int) -> set[int]:
        """Neighbours u of v (either direction) with |ts_u − ts_v| = 1 (Definition 3)."""
        return {u for u in self.succ[v] | self.pred[v] if abs(self.stage[u] - self.stage[v]) == 1}

    def creates_cycle(self, u: int, v: int) -> bool:
        """Would merging u and v make the hyper-node graph cyclic: is there a path between them
        through a third node?"""
        for a, b in ((u, v), (v, u)):
            stack = [w for w in self.succ[a] if w != b]
            seen: set[int] = set(stack)
            while stack:
                w = stack.pop()
                if w == b:
                    return True
                for x in self.succ[w]:
                    if x not in seen:
                        seen.add(x)
                        stack.append(x)
        return False

    def merge(self, v: int, u: int) -> int:
        """u joins v; returns v, now the hyper node of both."""
        self.members[v] += self.members.pop(u)
        self.weight[v] += self.weight.pop(u)
        for op_id in self.members[v]:
            self.node_of[op_id] = v
        for side, other in ((self.succ, self.pred), (self.pred, self.succ)):
            for w in side.pop(u):
                other[w].discard(u)
                if w != v:
                    side[v].add(w)
                    other[w].add(v)
            side[v].discard(u)
        self.update_stages()
        return v


# --- CLUSTER (Algorithm 1) ---------------------------------------------------------------------------
def _stays_alone(op: Op) -> bool:
    info = op_info(op.op_type)
    return info.opaque or info.recurrent


def _is_complex(op: Op) -> bool:
    return op.mapping == MappingType.MANY_TO_MANY and op.compute_intensive


def cluster(graph: Graph, weights: Weights, settings: Settings = Settings(),
            decisions: list[Decision] | None = None) -> list[list[str]]:
    """Algorithm 1: hyper nodes grown from affix sets under the weight threshold."""
    term = {op.id: loop_term(graph, op) for op in graph.ops}
    state = Clustering(graph, {op_id: weights.of(t) for op_id, t in term.items()})
    alone = {state.node_of[op.id] for op in graph.ops if _stays_alone(op)}
    complex_ops = {state.node_of[op.id]: int(_is_complex(op)) for op in graph.ops}
    candidates = set(state.members) - alone
    while candidates:
        v = max(candidates, key=lambda n: (state.weight[n], -min(graph.order[i]
                                                                 for i in state.members[n])))
        options = [u for u in state.affix_set(v) if u not in alone
                   and state.weight[v] + state.weight[u] < weights.threshold
                   and (settings.max_complex is None
                        or complex_ops[v] + complex_ops[u] <= settings.max_complex)]
        if not options:
            candidates.discard(v)
            if decisions is not None:
                decisions.append(Decision(_label(graph, state.members[v]), "-", False,
                                          "no affix node under the weight threshold"))
            continue
        u = min(options, key=lambda n: (state.weight[n], min(graph.order[i]
                                                              for i in state.members[n])))
        if decisions is not None:
            decisions.append(Decision(
                _label(graph, state.members[v]), _label(graph, state.members[u]), True,
                f"affix set: weight {state.weight[v] + state.weight[u]:.0f} < "
                f"{weights.threshold:.0f}"))
        candidates.discard(u)
        complex_ops[v] += complex_ops.pop(u)
        state.merge(v, u)
        # the merge moved stages: neighbours that could not merge before may now
        candidates |= (state.succ[v] | state.pred[v]) - alone
    return [sorted(m, key=graph.order.__getitem__) for m in state.members.values()]


def _label(graph: Graph, ops: Sequence[str]) -> str:
    return "+".join(sorted(ops, key=graph.order.__getitem__))


@register_partitioner("ago")
class AGO:
    """Partitioner `ago`: AGO's weighted clustering into arbitrary-structure subgraphs."""

    name = "ago"
    tuning = "divide-and-conquer"  # kiln.tune runs the reformer layer (§V) on its plans

    def __init__(self, settings: Settings = Settings()):
        self.settings = settings

    def weights(self, graph: Graph, store: ProfileStore) -> Weights:
        first = cluster(graph, default_weights(store, self.settings), self.settings)
        return fit_weights(graph, store, [[op.id] for op in graph.ops] + first, self.settings)

    def __call__(self, graph: Graph, store: ProfileStore) -> FusionPlan:
        decisions: list[Decision] = []
        groups = cluster(graph, self.weights(graph, store), self.settings, decisions)
        return build_plan(graph, groups, self.name, decisions)
