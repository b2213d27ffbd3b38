"""The rewriting engine of DNNFusion §4.2.

The ECG is partitioned at the ops that have none of the associative, commutative or distributive
properties (`OpInfo.properties`): a partition is a connected group of ops that have at least one.
A match of an associative, distributive or commutative rule may not span two partitions: every
matched op that has a property must lie in one partition (property-less ops, the partitioning
points, may be matched at its edge). The "simplify" rules are local clean-ups of exported graphs
(x·1, Reshape chains, BatchNormalization folding, ...) and apply anywhere.

Every rule is matched at every op of its root type; a match whose guard holds and whose
replacement has the root's shape and dtype becomes a candidate, scored by its exact delta: the
FLOPs (then bytes) of the ops it adds minus those of the ops that become dead, ops whose inputs are
all constant counting as folded. The candidate with the largest FLOP reduction is applied (ties:
fewer bytes, then the earlier op, then the earlier rule), the candidates around the change are
matched again, and this repeats until no candidate improves the graph. Partitions are independent,
so one work list for all of them gives what running the loop partition by partition gives.

Only strict improvements are applied, (FLOPs, bytes) decreasing lexicographically, so the loop
terminates. The exception is the `enabling` rules (Sub/Neg normalization, moving a scale through a
Transpose, ...), which change nothing by themselves: they are scored by looking ahead at the best
chain of at most `LOOKAHEAD` rewrites they start, and applied only when that chain improves the
graph. Enabling rules only move values in one direction, so they cannot undo each other; a step
limit guards the loop regardless.

The same graph always rewrites the same way: matching follows the graph's op order and the rule
registration order, and every tie is broken by them.

Floating-point rules reassociate (x·c1·c2 → x·(c1·c2), sums and products regrouped) and assume
finite values in each op's domain (√b·√b → b for b ≥ 0), like a compiler's fast-math mode; results
stay within the code generator's tolerance. Integer values are never reassociated, and integer
division is never turned into a multiplication (rules declare their dtypes; see `Rule.dtypes`).
"""
from __future__ import annotations

import re
from collections import ChainMap
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Sequence

import numpy as np

from kiln import fold as folding
from kiln.ecg import Graph, Op, Tensor, toposort
from kiln.ops import annotate, op_info
from kiln.rewrite import shapes
from kiln.rewrite.dsl import (SIMPLIFY, Alt, Fill, K, Match, Node, Rule, Term, Var, attr_of,
                              variables)
from kiln.rewrite.export import EXPORT_OPSET, node_from

LOOKAHEAD = 3  # longest chain of enabling rewrites looked through
_MISSING = object()


@dataclass(frozen=True)
class RewriteResult:
    graph: Graph
    rules_fired: dict[str, int]
    flops_before: int
    flops_after: int
    steps: tuple[tuple[str, str], ...] = ()  # (rule, root op id), in the order applied

    @classmethod
    def unchanged(cls, graph: Graph) -> "RewriteResult":
        return cls(graph, {}, graph.total_flops, graph.total_flops)


# --- the graph while it is rewritten ------------------------------------------------------------

class Work:
    """A mutable copy of an ECG: ops by id, producers and consumers by tensor, and an order key
    per op (a tuple; a replacement's ops take its root's key plus their index, which keeps the
    op order topological). Changes can be journaled and rolled back (`trial`), which is how the
    engine looks ahead without copying the graph."""

    def __init__(self, graph: Graph):
        self.tensors: dict[str, Tensor] = dict(graph.tensors)
        self.ops: dict[str, Op] = {op.id: op for op in graph.ops}
        self.key: dict[str, tuple[int, ...]] = {op.id: (i,) for i, op in enumerate(graph.ops)}
        self.producer: dict[str, str] = {t: op.id for op in graph.ops for t in op.outputs}
        self.consumers: dict[str, list[str]] = {}
        for op in graph.ops:
            for t in dict.fromkeys(op.present_inputs()):
                self.consumers.setdefault(t, []).append(op.id)
        self.inputs, self.outputs = graph.inputs, graph.outputs
        self.output_set = frozenset(graph.outputs)
        self.opset, self.name = graph.opset, graph.name
        self.next_tensor = 1 + max(_numbered("t", self.tensors), default=-1)
        self.next_op = 1 + max(_numbered("op", self.ops), default=-1)
        self.journal: list[tuple[dict, str, Any]] | None = None
        self.fold_cache: dict[tuple, tuple[list, list[np.ndarray]]] = {}

    # journaled mutation
    def _set(self, table: dict, key: str, value: Any) -> None:
        if self.journal is not None:
            self.journal.append((table, key, table.get(key, _MISSING)))
        table[key] = value

    def _drop(self, table: dict, key: str) -> None:
        if key in table:
            if self.journal is not None:
                self.journal.append((table, key, table[key]))
            del table[key]

    def set_tensor(self, tensor: Tensor) -> None:
        self._set(self.tensors, tensor.id, tensor)

    def drop_tensor(self, tensor_id: str) -> None:
        self._drop(self.tensors, tensor_id)

    @contextmanager
    def trial(self) -> Iterator[None]:
        """Changes made inside are undone on leaving."""
        outer, counters = self.journal, (self.next_tensor, self.next_op)
        self.journal = []
        try:
            yield
        finally:
            for table, key, value in reversed(self.journal):
                if value is _MISSING:
                    table.pop(key, None)
                else:
                    table[key] = value
            self.journal = outer
            self.next_tensor, self.next_op = counters

    def live_ops(self) -> set[str]:
        """Ops some model output depends on."""
        return _live(self)

    # the scope `annotate` and the FLOP rules read
    def activation_inputs(self, op: Op) -> tuple[str, ...]:
        return tuple(t for t in op.present_inputs() if not self.tensors[t].is_constant)

    def producer_op(self, tensor_id: str) -> Op | None:
        op_id = self.producer.get(tensor_id)
        return None if op_id is None else self.ops[op_id]

    def new_tensor_id(self) -> str:
        while f"t{self.next_tensor}" in self.tensors:
            self.next_tensor += 1
        self.next_tensor += 1
        return f"t{self.next_tensor - 1}"

    def new_op_id(self) -> str:
        while f"op{self.next_op}" in self.ops:
            self.next_op += 1
        self.next_op += 1
        return f"op{self.next_op - 1}"

    def add_op(self, op: Op, key: tuple[int, ...]) -> None:
        self._set(self.ops, op.id, op)
        self._set(self.key, op.id, key)
        for t in op.outputs:
            self._set(self.producer, t, op.id)
        for t in dict.fromkeys(op.present_inputs()):
            self._set(self.consumers, t, [*self.consumers.get(t, ()), op.id])

    def remove_op(self, op_id: str) -> Op:
        op = self.ops[op_id]
        self._drop(self.ops, op_id)
        self._drop(self.key, op_id)
        for t in op.outputs:
            if self.producer.get(t) == op_id:
                self._drop(self.producer, t)
        for t in dict.fromkeys(op.present_inputs()):
            users = [u for u in self.consumers.get(t, ()) if u != op_id]
            if users:
                self._set(self.consumers, t, users)
            else:
                self._drop(self.consumers, t)
        return op

    def replace_uses(self, old: str, new: str) -> list[str]:
        """Every consumer of `old` reads `new` instead; returns the ids of the ops changed."""
        changed = list(self.consumers.get(old, ()))
        for op_id in changed:
            op = self.ops[op_id]
            key = self.key[op_id]
            self.remove_op(op_id)
            inputs = tuple(new if t == old else t for t in op.inputs)
            self.add_op(annotate(replace(op, inputs=inputs), self), key)
        return changed

    def to_graph(self) -> Graph:
        """The ECG: ops in order, annotated; ops that reach no output and unused constants go."""
        live = self.live_ops()
        ordered = [op for op in sorted(self.ops.values(), key=lambda op: self.key[op.id])
                   if op.id in live]
        used = set(self.inputs) | set(self.outputs)
        for op in ordered:
            used.update(op.present_inputs())
            used.update(op.outputs)
        tensors = {t: v for t, v in self.tensors.items() if t in used}
        available = [t for t, v in tensors.items() if v.is_constant] + list(self.inputs)
        bare = toposort(ordered, available)
        draft = Graph(tensors, bare, self.inputs, self.outputs, self.opset, self.name)
        return draft.with_ops([annotate(op, draft) for op in bare])


def _live(work: "Work") -> set[str]:
    live, stack = set(), [work.producer[t] for t in work.outputs if t in work.producer]
    while stack:
        op_id = stack.pop()
        if op_id in live:
            continue
        live.add(op_id)
        stack.extend(work.producer[t] for t in work.ops[op_id].present_inputs()
                     if t in work.producer)
    return live


def _numbered(prefix: str, ids) -> Iterator[int]:
    pattern = re.compile(rf"{prefix}(\d+)$")
    for i in ids:
        found = pattern.match(i)
        if found:
            yield int(found.group(1))


# --- matching ----------------------------------------------------------------------------------

@dataclass
class _State:
    bind: dict[str, str | None]
    nodes: dict[str, Op]
    ops: list[Op]


def match_rule(work: Work, rule: Rule, root: Op) -> list[Match]:
    """Every distinct match of `rule`'s pattern rooted at `root`."""
    found: dict[frozenset, Match] = {}
    for st in _match(work, rule.pattern, root.outputs[0], _State({}, {}, [])):
        key = frozenset(st.bind.items())
        if key not in found:
            found[key] = Match(work, root, st.bind, st.nodes, st.ops)
    return list(found.values())


def _match(work: Work, term: Term, tid: str | None, st: _State) -> Iterator[_State]:
    if isinstance(term, Var):
        if tid is None:
            if term.kind in ("param", "opt") and st.bind.get(term.name, None) is None:
                yield _State({**st.bind, term.name: None}, st.nodes, st.ops)
            return
        prev = st.bind.get(term.name, _MISSING)
        if prev is not _MISSING:
            if prev == tid:
                yield st
            return
        if term.kind in ("const", "param") and not work.tensors[tid].is_constant:
            return
        yield _State({**st.bind, term.name: tid}, st.nodes, st.ops)
    elif isinstance(term, Fill):
        data = None if tid is None else work.tensors[tid].data
        if data is not None and data.size > 0 and bool(np.all(data == term.value)):
            yield st
    elif isinstance(term, Node):
        yield from _match_node(work, term, tid, st)
    elif isinstance(term, Alt):
        for option in term.options:
            yield from _match(work, option, tid, st)
    else:
        raise TypeError(f"{term!r} cannot appear in a pattern")


def _match_node(work: Work, term: Node, tid: str | None, st: _State) -> Iterator[_State]:
    if tid is None:
        return
    if term.name is not None and st.bind.get(term.name, tid) != tid:
        return
    op = work.producer_op(tid)
    if op is None or op.op_type not in term.ops or len(op.outputs) != 1:
        return
    for key, want in term.attrs.items():
        have = attr_of(op, key, opset=work.opset)
        if not (want(have) if callable(want) else _same(have, want)):
            return
    inputs = list(op.inputs)
    while inputs and inputs[-1] is None:
        inputs.pop()
    if len(inputs) > len(term.args):
        return
    inputs += [None] * (len(term.args) - len(inputs))
    bind = st.bind if term.name is None else {**st.bind, term.name: tid}
    nodes = st.nodes if term.name is None else {**st.nodes, term.name: op}
    start = _State(bind, nodes, st.ops + [op])
    orders = [term.args]
    if (op_info(op.op_type).symmetric or term.any_order) and len(term.args) == 2:
        orders.append(term.args[::-1])
    for args in orders:
        yield from _match_args(work, args, inputs, start)


def _match_args(work: Work, args: Sequence[Term], inputs: Sequence[str | None],
                st: _State) -> Iterator[_State]:
    if not args:
        yield st
        return
    for after_first in _match(work, args[0], inputs[0], st):
        yield from _match_args(work, args[1:], inputs[1:], after_first)


def _same(have: Any, want: Any) -> bool:
    if isinstance(have, (list, tuple, np.ndarray)) or isinstance(want, (list, tuple, np.ndarray)):
        return np.array_equal(np.asarray(have), np.asarray(want))
    return have == want


# --- replacements ------------------------------------------------------------------------------

@dataclass
class _NewOp:
    op_type: str
    inputs: tuple[str | None, ...]
    attrs: dict[str, Any]
    output: str  # a placeholder, or the root's output id
    foldable: bool


@dataclass
class Plan:
    """A replacement instantiated for one match, before anything changes: the ops to create (in
    order; placeholders `%n` name their outputs and new constants), and the tensor that takes
    the root's place."""

    result: str
    new_ops: list[_NewOp] = field(default_factory=list)
    tensors: dict[str, Tensor] = field(default_factory=dict)  # placeholders and new constants
    identity: bool = False  # the root's output is a model output: an Identity keeps its id


class _Scope:
    """What `annotate` and the FLOP rules need of a graph: tensors, and which inputs are runtime."""

    def __init__(self, tensors):
        self.tensors = tensors

    def activation_inputs(self, op: Op) -> tuple[str, ...]:
        return tuple(t for t in op.present_inputs() if not self.tensors[t].is_constant)


def instantiate(work: Work, rule: Rule, m: Match) -> Plan:
    """The replacement for `m`; raises shapes.ShapeError when it does not type-check."""
    template = rule.replacement if isinstance(rule.replacement, Term) else rule.replacement(m)
    root_out = m.root.outputs[0]
    plan = Plan(result="")
    scope = ChainMap(plan.tensors, work.tensors)
    counter = iter(range(1 << 30))

    def constant(data: np.ndarray) -> str:
        ph = f"%{next(counter)}"
        data = np.asarray(data)
        plan.tensors[ph] = Tensor(ph, tuple(data.shape), data.dtype.name, "", data)
        return ph

    built: dict[int, str] = {}  # a sub-term object used twice is built once

    def build(term: Term, dtype: str | None, is_root: bool) -> str | None:
        if isinstance(term, Node) and not is_root and id(term) in built:
            return built[id(term)]
        if isinstance(term, Var):
            if term.name not in m.bind:
                raise KeyError(f"rule {rule.name}: the replacement uses unbound {term.name}")
            return m.bind[term.name]
        if isinstance(term, Fill):
            return constant(np.asarray(term.value, dtype=dtype or m.out.dtype))
        if isinstance(term, K):
            return constant(term.fn(m))
        if not isinstance(term, Node):
            raise TypeError(f"rule {rule.name}: {term!r} cannot appear in a replacement")
        refs: list[str | None] = [None] * len(term.args)
        for i, arg in enumerate(term.args):
            if not isinstance(arg, Fill):
                refs[i] = build(arg, None, False)
        hint = next((scope[r].dtype for r in refs if r is not None), None)
        for i, arg in enumerate(term.args):
            if isinstance(arg, Fill):
                refs[i] = build(arg, hint, False)
        attrs = dict(m.op(term.like).attrs) if term.like else {}
        attrs.update({k: (val(m) if callable(val) else val) for k, val in term.attrs.items()})
        while refs and refs[-1] is None:
            refs.pop()
        infos = [None if r is None else scope[r] for r in refs]
        shape, out_dtype = shapes.infer(term.ops[0], infos, attrs)
        present = [i for i in infos if i is not None]
        in_bytes = sum(i.nbytes for i in present)
        out_bytes = Tensor("", shape, out_dtype).nbytes
        foldable = (bool(present) and all(i.is_constant or _will_fold(plan, i.id) for i in present)
                    and folding.foldable(term.ops[0]) and folding.worth_storing(out_bytes, in_bytes))
        out = root_out if is_root else f"%{next(counter)}"
        if not is_root:
            plan.tensors[out] = Tensor(out, shape, out_dtype)
        elif (shape, out_dtype) != (m.out.shape, m.out.dtype):
            raise shapes.ShapeError(f"the replacement gives {out_dtype}{list(shape)}, the pattern "
                                    f"{m.out.dtype}{list(m.out.shape)}")
        plan.new_ops.append(_NewOp(term.ops[0], tuple(refs), attrs, out, foldable))
        built[id(term)] = out
        return out

    result = build(template, None, True)
    if result is None:
        raise shapes.ShapeError("the replacement is empty")
    if result == root_out and not isinstance(template, Node):
        raise ValueError(f"rule {rule.name}: the replacement refers to the root's own output")
    if result != root_out:  # the root's value is an existing tensor or a new constant
        t = scope[result]
        if (t.shape, t.dtype) != (m.out.shape, m.out.dtype):
            raise shapes.ShapeError(f"the replacement gives {t.dtype}{list(t.shape)}, the "
                                    f"pattern {m.out.dtype}{list(m.out.shape)}")
        if root_out in work.output_set:
            plan.identity = True
    plan.result = result
    return plan


def _will_fold(plan: Plan, ref: str) -> bool:
    return any(n.output == ref and n.foldable for n in plan.new_ops)


def delta(work: Work, m: Match, plan: Plan) -> tuple[int, int]:
    """(FLOPs, bytes) of the graph after the rewrite minus before."""
    scope = _Scope(ChainMap(plan.tensors, work.tensors))
    flops = nbytes = 0
    for n in plan.new_ops:
        if n.foldable:
            continue
        op = Op("%op", n.op_type, n.inputs, (n.output,), n.attrs)
        flops += int(op_info(n.op_type).flops(op, scope))
        nbytes += sum(scope.tensors[t].nbytes for t in (*op.present_inputs(), n.output))
    if plan.identity:
        nbytes += 2 * m.out.nbytes
    for op in dead_ops(work, m, plan):
        flops -= op.flops
        nbytes -= op.bytes
    return flops, nbytes


def dead_ops(work: Work, m: Match, plan: Plan) -> list[Op]:
    """The matched ops that the rewrite leaves without consumers: the root, and interior ops all
    of whose consumers die (and whose output is neither a model output nor reused)."""
    keep = {t for n in plan.new_ops for t in n.inputs if t is not None} | {plan.result}
    dead = {m.root.id: m.root}
    interior = {op.id: op for op in m.ops[1:]}
    for op in sorted(interior.values(), key=lambda o: work.key[o.id], reverse=True):
        out = op.outputs[0]
        if out in work.output_set or out in keep or op.id in dead:
            continue
        if all(user in dead for user in work.consumers.get(out, ())):
            dead[op.id] = op
    return list(dead.values())


@dataclass
class Changes:
    touched: set[str] = field(default_factory=set)  # tensors whose producer or users changed
    added: list[str] = field(default_factory=list)  # new op ids
    removed: set[str] = field(default_factory=set)  # op ids
    constant: set[str] = field(default_factory=set)  # tensors that became constant


def apply(work: Work, m: Match, plan: Plan) -> Changes:
    """Rewrite `work` in place (`m` and `plan` may come from another copy of the same graph)."""
    changes = Changes()
    root = m.root
    root_out = root.outputs[0]
    base = _position(work, m, plan)
    ids: dict[str, str] = {}
    for ph, tensor in plan.tensors.items():
        if tensor.is_constant:
            ids[ph] = work.new_tensor_id()
            work.set_tensor(replace(tensor, id=ids[ph]))

    def ref(t: str | None) -> str | None:
        return None if t is None else ids.get(t, t)

    removed_inputs = set(root.present_inputs())
    work.remove_op(root.id)
    changes.removed.add(root.id)
    became_constant: list[str] = []
    for index, n in enumerate(plan.new_ops):
        inputs = tuple(ref(t) for t in n.inputs)
        out = root_out if n.output == root_out else work.new_tensor_id()
        ids[n.output] = out
        template = plan.tensors.get(n.output) or work.tensors[root_out]
        if n.foldable:
            data = fold(work, n.op_type, inputs, n.attrs)[0]
            work.set_tensor(Tensor(out, template.shape, template.dtype,
                                   work.tensors[root_out].source_name if out == root_out else "",
                                   data))
            became_constant.append(out)
        else:
            if out != root_out:
                work.set_tensor(Tensor(out, template.shape, template.dtype))
            op = annotate(Op(work.new_op_id(), n.op_type, inputs, (out,), n.attrs), work)
            work.add_op(op, base + (index,))
            changes.added.append(op.id)
        changes.touched.update(t for t in inputs if t is not None)
        changes.touched.add(out)
    result = ref(plan.result)
    if result != root_out:  # the root's value is an existing tensor (or a new constant)
        changes.touched.update((result, root_out))
        if plan.identity:
            op = annotate(Op(work.new_op_id(), "Identity", (result,), (root_out,)), work)
            work.add_op(op, base + (len(plan.new_ops),))
            changes.added.append(op.id)
        else:
            changes.touched.update(t for c in work.replace_uses(root_out, result)
                                   for t in work.ops[c].outputs)
            work.drop_tensor(root_out)
            if work.tensors[result].is_constant:
                became_constant.append(result)
    changes.touched |= removed_inputs
    collect_garbage(work, removed_inputs | {ids[ph] for ph, t in plan.tensors.items()
                                            if t.is_constant}, changes)
    changes.constant.update(became_constant)
    propagate_constants(work, became_constant, changes)
    return changes


def _position(work: Work, m: Match, plan: Plan) -> tuple[int, ...]:
    """Where the replacement's ops go in the op order: where the first op it replaces was, when
    everything they read is computed before that point (so the graph keeps its program order:
    an op order the planner breaks ties by), else where the root was. A replacement's ops take
    this key plus their index: no other op has a key extending the key of an op still present."""
    first = min((work.key[op.id] for op in dead_ops(work, m, plan)), default=work.key[m.root.id])
    for n in plan.new_ops:
        for t in n.inputs:
            producer = work.producer.get(t) if t is not None else None
            if producer is not None and work.key[producer] >= first:
                return work.key[m.root.id]
    return first


def fold(work: Work, op_type: str, inputs: Sequence[str | None], attrs: dict[str, Any],
         outputs: int = 1) -> list[np.ndarray]:
    """Evaluate an op on constant inputs (`kiln.fold`; results are cached by the identity of the
    input arrays, which the cache keeps alive)."""
    values = [None if t is None else work.tensors[t].data for t in inputs]
    key = (op_type, repr(sorted(attrs.items())), tuple(id(v) for v in values))
    hit = work.fold_cache.get(key)
    if hit is None:
        node = node_from(op_type, [t or "" for t in inputs], [f"out{i}" for i in range(outputs)],
                         attrs)
        hit = work.fold_cache[key] = (values, folding.evaluate(node, values, EXPORT_OPSET))
    return hit[1]


def collect_garbage(work: Work, tensors, changes: Changes) -> None:
    """Remove ops none of whose outputs is used, and constants nothing reads, from `tensors` up."""
    stack = [t for t in tensors if t is not None]
    while stack:
        t = stack.pop()
        if t not in work.tensors or work.consumers.get(t) or t in work.output_set:
            continue
        producer = work.producer_op(t)
        if producer is None:
            if work.tensors[t].is_constant and t not in work.inputs:
                work.drop_tensor(t)
            continue
        if any(work.consumers.get(o) or o in work.output_set for o in producer.outputs):
            continue
        work.remove_op(producer.id)
        changes.removed.add(producer.id)
        for o in producer.outputs:
            work.drop_tensor(o)
        changes.touched.update(producer.present_inputs())
        stack.extend(producer.present_inputs())


def propagate_constants(work: Work, tensors: list[str], changes: Changes) -> None:
    """Fold every op whose inputs have all become constant, transitively."""
    stack = list(tensors)
    while stack:
        t = stack.pop()
        for op_id in list(work.consumers.get(t, ())):
            op = work.ops.get(op_id)
            if op is None or not folding.foldable(op.op_type):
                continue
            if not all(work.tensors[i].is_constant for i in op.present_inputs()):
                continue
            in_bytes = sum(work.tensors[i].nbytes for i in op.present_inputs())
            out_bytes = sum(work.tensors[o].nbytes for o in op.outputs)
            if not folding.worth_storing(out_bytes, in_bytes):
                continue
            results = fold(work, op.op_type, op.inputs, op.attrs, len(op.outputs))
            work.remove_op(op.id)
            changes.removed.add(op.id)
            for name, data in zip(op.outputs, results):
                old = work.tensors[name]
                work.set_tensor(replace(old, data=np.asarray(data, dtype=old.dtype)))
                changes.touched.add(name)
                changes.constant.add(name)
                stack.append(name)
            collect_garbage(work, op.present_inputs(), changes)


# --- partitions --------------------------------------------------------------------------------

def partitions(work: Work) -> dict[str, str]:
    """op id -> partition id, for the ops that have at least one math property."""
    parent = {op_id: op_id for op_id, op in work.ops.items() if op.properties}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for t, producer in work.producer.items():
        if producer not in parent:
            continue
        for user in work.consumers.get(t, ()):
            if user in parent:
                a, b = find(producer), find(user)
                if a != b:
                    parent[max(a, b)] = min(a, b)
    return {op_id: find(op_id) for op_id in parent}


def within_one_partition(rule: Rule, m: Match, labels: dict[str, str]) -> bool:
    if rule.category == SIMPLIFY:
        return True
    found = {labels[op.id] for op in m.ops if op.id in labels}
    return len(found) <= 1


def locally_connected(m: Match) -> bool:
    """The matched ops that have a property are connected through matched ops that have one
    (then they certainly lie in one partition)."""
    prop = {op.id for op in m.ops if op.properties}
    if len(prop) <= 1:
        return True
    seen, stack = set(), [next(iter(prop))]
    while stack:
        op_id = stack.pop()
        if op_id in seen:
            continue
        seen.add(op_id)
        op = m.work.ops[op_id]
        near = [m.work.producer.get(t) for t in op.present_inputs()]
        near += [u for t in op.outputs for u in m.work.consumers.get(t, ())]
        stack.extend(n for n in near if n in prop and n not in seen)
    return seen == prop


# --- the greedy loop ---------------------------------------------------------------------------

@dataclass(eq=False)
class Candidate:
    rule: Rule
    index: int  # registration order, for ties
    match: Match
    plan: Plan
    delta: tuple[int, int]
    score: tuple[int, int]  # delta, plus the best follow-up for enabling rules
    local: bool  # needs no partition check (a simplify rule, or its property ops are adjacent)

    def sort_key(self, work: Work) -> tuple:
        return (*self.score, work.key[self.match.root.id], self.index)


class Engine:
    def __init__(self, rules: Sequence[Rule], lookahead: int = LOOKAHEAD):
        self.rules = list(rules)
        self.lookahead = lookahead
        self.by_type: dict[str, list[tuple[int, Rule]]] = {}
        for index, r in enumerate(self.rules):
            for op_type in r.root_ops:
                self.by_type.setdefault(op_type, []).append((index, r))
        self.needs = [tuple(_producer_types(a) for a in r.pattern.args) for r in self.rules]
        self.radius = 1 + max((r.depth for r in self.rules), default=0)

    def candidates(self, work: Work, op: Op, lookahead: int, distance: int = 0
                   ) -> dict[int, list[Candidate]]:
        """Candidates rooted at `op`, by rule index, for the rules whose patterns reach
        `distance` ops upstream (a change that far up cannot affect shallower patterns)."""
        found: dict[int, list[Candidate]] = {}
        types = [None if t is None or t not in work.producer else
                 work.ops[work.producer[t]].op_type for t in op.inputs]
        for index, r in self.by_type.get(op.op_type, ()):
            if r.depth < distance or not self.may_match(index, op, types):
                continue
            made = [c for m in match_rule(work, r, op)
                    if (c := self.consider(work, r, index, m, lookahead)) is not None]
            if made:
                found[index] = made
        return found

    def may_match(self, index: int, op: Op, types: list[str | None]) -> bool:
        """A quick test of the root's operands against the op types the pattern needs there."""
        needs = self.needs[index]

        def fits(arg: int, position: int) -> bool:
            need = needs[arg]
            return need is None or (position < len(types) and types[position] in need)

        symmetric = op_info(op.op_type).symmetric
        if (symmetric or self.rules[index].pattern.any_order) and len(needs) == 2:
            return (fits(0, 0) and fits(1, 1)) or (fits(0, 1) and fits(1, 0))
        return all(fits(i, i) for i in range(len(needs)))

    def consider(self, work: Work, r: Rule, index: int, m: Match, lookahead: int,
                 force: bool = False) -> Candidate | None:
        """A candidate for `m`, or None when a check refuses it (`force` skips the rule's guard
        and dtypes and the profitability check, not the replacement's shape check)."""
        if not force and not (dtypes_allowed(r, m) and (r.guard is None or r.guard(m))):
            return None
        try:
            plan = instantiate(work, r, m)
        except shapes.ShapeError:
            return None
        d = delta(work, m, plan)
        score = d
        local = r.category == SIMPLIFY or locally_connected(m)
        if force:
            return Candidate(r, index, m, plan, d, score, local)
        if r.enabling and lookahead > 0:
            follow = self.follow_up(work, m, plan, lookahead - 1)
            if follow is not None and follow < (0, 0):
                score = (d[0] + follow[0], d[1] + follow[1])
        if score >= (0, 0):
            return None
        return Candidate(r, index, m, plan, d, score, local)

    def follow_up(self, work: Work, m: Match, plan: Plan, lookahead: int) -> tuple[int, int] | None:
        """The best score among the rewrites that apply around `m` once it is applied."""
        with work.trial():
            changes = apply(work, m, plan)
            near = self.affected(work, changes)
            found = [c for op_id in sorted(near, key=work.key.__getitem__)
                     for cs in self.candidates(work, work.ops[op_id], lookahead,
                                               near[op_id]).values() for c in cs]
            best = self.select(work, found)
            return None if best is None else best.score

    def select(self, work: Work, found: list[Candidate]) -> Candidate | None:
        """The best candidate whose match lies in one partition."""
        if not found:
            return None
        first = min(found, key=lambda c: c.sort_key(work))
        if first.local:
            return first
        labels = partitions(work)
        for cand in sorted(found, key=lambda c: c.sort_key(work)):
            if cand.local or within_one_partition(cand.rule, cand.match, labels):
                return cand
        return None

    def affected(self, work: Work, changes: Changes) -> dict[str, int]:
        """Ops whose matches may have changed, with their distance downstream of the change:
        new ops and the ops around every tensor the rewrite touched (0), and their consumers up
        to the deepest pattern."""
        frontier = set(changes.added)
        for t in changes.touched:
            producer = work.producer.get(t)
            if producer is not None:
                frontier.add(producer)
            tensor = work.tensors.get(t)
            if tensor is None or not tensor.is_constant or t in changes.constant:
                # A constant's users do not change with it: it is only ever a leaf of a match,
                # whose consumers do not matter (a weight shared by many layers stays quiet).
                frontier.update(work.consumers.get(t, ()))
        frontier &= work.ops.keys()
        found = dict.fromkeys(frontier, 0)
        for distance in range(1, self.radius + 1):
            frontier = {user for op_id in frontier for t in work.ops[op_id].outputs
                        for user in work.consumers.get(t, ()) if user not in found}
            found.update(dict.fromkeys(frontier, distance))
        return found

    def run(self, graph: Graph, max_steps: int | None = None) -> RewriteResult:
        work = Work(graph)
        limit = max_steps if max_steps is not None else 10 * len(graph.ops) + 100
        table = {op_id: self.candidates(work, op, self.lookahead)
                 for op_id, op in list(work.ops.items())}
        fired: dict[str, int] = {}
        steps: list[tuple[str, str]] = []
        while len(steps) < limit:
            best = self.select(work, [c for found in table.values() for cs in found.values()
                                      for c in cs])
            if best is None:
                break
            changes = apply(work, best.match, best.plan)
            fired[best.rule.name] = fired.get(best.rule.name, 0) + 1
            steps.append((best.rule.name, best.match.root.id))
            for op_id in changes.removed:
                table.pop(op_id, None)
            for op_id, distance in self.affected(work, changes).items():
                kept = {i: cs for i, cs in table.get(op_id, {}).items()
                        if self.rules[i].depth < distance}
                table[op_id] = kept | self.candidates(work, work.ops[op_id], self.lookahead,
                                                      distance)
        result = work.to_graph()
        return RewriteResult(result, dict(sorted(fired.items())), graph.total_flops,
                             result.total_flops, tuple(steps))


def _producer_types(term: Term) -> frozenset[str] | None:
    """The op types that may produce the tensor `term` matches (None: anything)."""
    if isinstance(term, Node):
        return frozenset(term.ops)
    if isinstance(term, Alt) and all(isinstance(o, Node) for o in term.options):
        return frozenset(t for o in term.options for t in o.ops)
    return None


def dtypes_allowed(r: Rule, m: Match) -> bool:
    """The values the pattern computes and reads (parameters aside) have one of `r.dtypes`."""
    if r.dtypes is None:
        return True
    if any(m.work.tensors[op.outputs[0]].dtype not in r.dtypes for op in m.ops):
        return False
    return all(m.dtype(v.name) in r.dtypes for v in variables(r.pattern)
               if v.kind not in ("param", "index") and m.bind.get(v.name) is not None)


# --- entry points ------------------------------------------------------------------------------

def rewrite(graph: Graph, rules: Sequence[Rule] | None = None, *,
            max_steps: int | None = None, lookahead: int = LOOKAHEAD) -> RewriteResult:
    """Apply the math-property rules (all registered rules by default) to `graph`."""
    if rules is None:
        from kiln.rewrite import all_rules
        rules = all_rules()
    return Engine(rules, lookahead).run(graph, max_steps)


def apply_once(graph: Graph, r: Rule, *, force: bool = False, at: str | None = None
               ) -> Graph | None:
    """Apply `r` at its first match (in op order, or at op `at`) whatever it gains, or return
    None when nothing matches or a check refuses every match. For tests: `force` skips the rule's
    guard and dtypes (to show what they prevent), not the replacement's shape and dtype check."""
    work = Work(graph)
    engine = Engine([r])
    roots = [work.ops[at]] if at is not None else sorted(work.ops.values(),
                                                        key=lambda o: work.key[o.id])
    for op in roots:
        if op.op_type not in r.root_ops:
            continue
        for m in match_rule(work, r, op):
            if not force and not (dtypes_allowed(r, m) and (r.guard is None or r.guard(m))):
                continue
            cand = engine.consider(work, r, 0, m, 0, force=True)
            if cand is not None:
                apply(work, cand.match, cand.plan)
                return work.to_graph()
    return None
