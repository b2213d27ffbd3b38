"""Kernel signatures, machine facts, the roofline cost model and the SQLite profile store."""
from __future__ import annotations

import json
import math
import multiprocessing
import os
import sqlite3
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kiln.ecg import Graph, Op, Tensor
from kiln.mapping import MappingType
from kiln.profile import COST_MODEL, MEASURED, PREDICTED, Estimate
from kiln.profile import machine as machine_mod
from kiln.profile.machine import MachineFacts, host_machine
from kiln.profile.roofline import LAUNCH_OVERHEAD_S, RooflineModel
from kiln.profile.sqlite_store import MAX_SAMPLES, SQLiteProfileStore
from kiln.signature import canonical_json, describe_block, kernel_signature

O2O, REO, SHU, O2M, M2M = (MappingType.ONE_TO_ONE, MappingType.REORGANIZE, MappingType.SHUFFLE,
                           MappingType.ONE_TO_MANY, MappingType.MANY_TO_MANY)

MACHINE = MachineFacts(cpu_model="Test CPU", logical_cores=2, isa=("avx2", "fma"),
                       l1d_bytes=32 << 10, l2_bytes=1 << 20, l3_bytes=32 << 20, arch="x86_64",
                       peak_gflops=100.0, bandwidth_gbs=20.0)
OTHER_MACHINE = replace(MACHINE, cpu_model="Other CPU")


# --- graph building ---------------------------------------------------------------------------

def numel(shape):
    return math.prod(shape)


class Builder:
    """Small ECGs by hand: ids get a prefix so two builds of one model share no ids or names."""

    def __init__(self, prefix: str = "t"):
        self.prefix = prefix
        self.tensors: dict[str, Tensor] = {}
        self.ops: list[Op] = []
        self.inputs: list[str] = []

    def _id(self, kind: str) -> str:
        return f"{self.prefix}_{kind}{len(self.tensors) + len(self.ops)}"

    def input(self, shape, dtype="float32") -> str:
        t = self._id("in")
        self.tensors[t] = Tensor(t, tuple(shape), dtype, source_name=f"{self.prefix}/input")
        self.inputs.append(t)
        return t

    def const(self, value) -> str:
        data = np.asarray(value)
        t = self._id("w")
        self.tensors[t] = Tensor(t, data.shape, data.dtype.name, f"{self.prefix}/weight", data)
        return t

    def op(self, op_type, inputs, shape, mapping, *, flops=None, ci=False, dtype="float32",
           attrs=None) -> str:
        out = self._id("v")
        self.tensors[out] = Tensor(out, tuple(shape), dtype, source_name=f"{self.prefix}/{op_type}")
        op_id = self._id("op")
        op = Op(op_id, op_type, tuple(inputs), (out,), dict(attrs or {}),
                source_name=f"{self.prefix}/{op_type}_node")
        # Annotations set by hand (kiln.ops.annotate is not relied on here).
        op = replace(op, mapping=mapping, compute_intensive=ci,
                     flops=numel(shape) if flops is None else flops)
        self.ops.append(op)
        return out

    def graph(self, outputs) -> Graph:
        return Graph(self.tensors, self.ops, self.inputs, outputs, opset=17, name=self.prefix)

    def op_of(self, tensor: str) -> str:
        return next(op.id for op in self.ops if tensor in op.outputs)


def conv_block_graph(prefix="t", *, shape=(1, 8, 16, 16), dtype="float32", kernel=3,
                     extra_prefix_ops=0, weight_seed=0, swap_add=False):
    """[extra ops] → Conv(w) → Add(bias) → Relu → output; returns (graph, block op ids)."""
    b = Builder(prefix)
    x = b.input(shape, dtype)
    for _ in range(extra_prefix_ops):
        x = b.op("Neg", [x], shape, O2O, dtype=dtype)
    rng = np.random.default_rng(weight_seed)
    w = b.const(rng.standard_normal((8, shape[1], kernel, kernel)).astype(dtype))
    bias = b.const(rng.standard_normal((1, 8, 1, 1)).astype(dtype))
    out_shape = (shape[0], 8, shape[2], shape[3])
    c = b.op("Conv", [x, w], out_shape, M2M, ci=True, dtype=dtype,
             attrs={"kernel_shape": [kernel, kernel], "pads": [kernel // 2] * 4,
                    "strides": [1, 1]})
    a = b.op("Add", [bias, c] if swap_add else [c, bias], out_shape, O2M, dtype=dtype)
    r = b.op("Relu", [a], out_shape, O2O, dtype=dtype)
    g = b.graph([r])
    return g, [b.op_of(c), b.op_of(a), b.op_of(r)]


# --- signatures -------------------------------------------------------------------------------

def test_signature_ignores_ids_names_weights_and_position():
    g1, block1 = conv_block_graph("model_a", weight_seed=1)
    g2, block2 = conv_block_graph("other_model", weight_seed=2, extra_prefix_ops=3)
    assert kernel_signature(g1, block1) == kernel_signature(g2, block2)
    assert describe_block(g1, block1) == describe_block(g2, block2)
    # Order of the op ids given does not matter: the graph's topological order is used.
    assert kernel_signature(g1, block1[::-1]) == kernel_signature(g1, block1)
    assert len(kernel_signature(g1, block1)) == 64


def test_description_is_json_without_ids_or_names():
    g, block = conv_block_graph("secretmodel")
    text = canonical_json(describe_block(g, block))
    assert json.loads(text) == describe_block(g, block)
    assert "secretmodel" not in text
    assert not any(t in text for t in g.tensors) and not any(op.id in text for op in g.ops)


@pytest.mark.parametrize("change", [
    {"shape": (1, 8, 32, 16)},
    {"dtype": "float16"},
    {"kernel": 5},
    {"swap_add": True},
])
def test_signature_changes_with_shape_dtype_attr_and_wiring(change):
    base, block = conv_block_graph()
    changed, block2 = conv_block_graph(**change)
    assert kernel_signature(base, block) != kernel_signature(changed, block2)


def test_signature_wiring_and_liveness():
    def graph(second_input_is_x: bool, relu_live: bool):
        b = Builder()
        x = b.input((4, 4))
        y = b.input((4, 4))
        r = b.op("Relu", [x], (4, 4), O2O)
        s = b.op("Sub", [r, x if second_input_is_x else y], (4, 4), O2O)
        g = b.graph([s, r] if relu_live else [s])
        return g, [b.op_of(r), b.op_of(s)]

    sigs = {kernel_signature(*graph(a, live)) for a in (True, False) for live in (True, False)}
    assert len(sigs) == 4  # reading x twice vs two inputs; an intermediate kept or written


def test_signature_of_array_attrs_and_mapping():
    def graph(attr, mapping=O2O):
        b = Builder()
        x = b.input((2, 3))
        y = b.op("Custom", [x], (2, 3), mapping, attrs={"table": attr, "alpha": 0.5})
        return b.graph([y]), [b.ops[0].id]

    a = kernel_signature(*graph(np.arange(6, dtype=np.float32)))
    assert a == kernel_signature(*graph(np.arange(6, dtype=np.float32)))
    assert a != kernel_signature(*graph(np.arange(6, dtype=np.float32) + 1))
    assert a != kernel_signature(*graph(np.arange(6, dtype=np.float64)))
    assert a != kernel_signature(*graph(np.arange(6, dtype=np.float32), mapping=SHU))
    assert kernel_signature(*graph(float("nan"))) == kernel_signature(*graph(float("nan")))


def test_signature_rejects_unknown_ops():
    g, block = conv_block_graph()
    with pytest.raises(ValueError, match="nope"):
        kernel_signature(g, block + ["nope"])
    with pytest.raises(ValueError):
        kernel_signature(g, [])


# --- roofline ---------------------------------------------------------------------------------

def same(est: Estimate, seconds: float, source: str) -> bool:
    return est.source == source and est.seconds == pytest.approx(seconds, rel=1e-12)


def split_latency(model, graph, *blocks):
    return sum(model.latency(graph, b).seconds for b in blocks)


def test_fused_elementwise_chain_is_cheaper_than_its_parts():
    b = Builder()
    shape = (1, 256, 1024)
    x = b.input(shape)
    y = b.input(shape)
    r = b.op("Relu", [x], shape, O2O)
    m = b.op("Mul", [r, b.const(np.float32(2.0))], shape, O2M)
    a = b.op("Add", [m, y], shape, O2O)
    g = b.graph([a])
    ids = [b.op_of(r), b.op_of(m), b.op_of(a)]
    model = RooflineModel(MACHINE)
    fused = model.latency(g, ids)
    assert fused.source == COST_MODEL and fused.seconds > 0
    assert fused.seconds < split_latency(model, g, *[[i] for i in ids])
    assert fused.seconds < split_latency(model, g, ids[:2], ids[2:])
    # Fused: read x, y and the scalar constant, write the output, once each.
    parts = model.breakdown(g, ids)
    assert parts.bytes_in == 2 * numel(shape) * 4 + 4 and parts.bytes_out == numel(shape) * 4
    assert parts.redundant_flops == 0 and parts.penalty_bytes == 0
    assert model.latency(g, ids) == fused  # deterministic


def broadcast_graph(m: int, n: int = 1024):
    """Exp on [1,1,N], then Add broadcasting it against [1,M,1] to [1,M,N]."""
    b = Builder()
    x = b.input((1, 1, n))
    y = b.input((1, m, 1))
    e = b.op("Exp", [x], (1, 1, n), O2O, flops=8 * n)  # transcendental: ~8 FLOPs per element
    a = b.op("Add", [e, y], (1, m, n), O2M)
    return b.graph([a]), b.op_of(e), b.op_of(a)


def test_broadcast_of_computed_value_is_charged_for_recompute():
    model = RooflineModel(MACHINE)
    g, exp, add = broadcast_graph(m=4096)
    parts = model.breakdown(g, [exp, add])
    assert parts.redundant_flops == 8 * 1024 * (4096 - 1)
    assert model.latency(g, [exp, add]).seconds > split_latency(model, g, [exp], [add])
    # With a small broadcast factor the fusion still pays off.
    g, exp, add = broadcast_graph(m=2)
    assert model.latency(g, [exp, add]).seconds < split_latency(model, g, [exp], [add])


@pytest.mark.parametrize("computed_shape", [(1, 512, 1), (1, 1, 1)])
def test_broadcast_along_inner_axes_is_hoisted_not_recomputed(computed_shape):
    """A per-row value (LayerNorm's 1/sqrt(var + eps)) or a computed scalar, broadcast along the
    innermost axes, is computed once per row and kept in a register: no recompute charge."""
    b = Builder()
    x = b.input((1, 512, 1024))
    v = b.input(computed_shape)
    s = b.op("Sqrt", [v], computed_shape, O2O, flops=8 * numel(computed_shape))
    d = b.op("Div", [x, s], (1, 512, 1024), O2M)
    g = b.graph([d])
    model = RooflineModel(MACHINE)
    ids = [b.op_of(s), b.op_of(d)]
    assert model.breakdown(g, ids).redundant_flops == 0
    assert model.latency(g, ids).seconds < split_latency(model, g, ids[:1], ids[1:])


def test_broadcast_of_a_reduction_is_not_recomputed():
    """Softmax-like: ReduceMax (Many-to-Many) then Sub broadcasting its result: kept, not redone."""
    b = Builder()
    x = b.input((1, 512, 1024))
    mx = b.op("ReduceMax", [x], (1, 512, 1), M2M, flops=numel((1, 512, 1024)))
    s = b.op("Sub", [x, mx], (1, 512, 1024), O2M)
    g = b.graph([s])
    model = RooflineModel(MACHINE)
    ids = [b.op_of(mx), b.op_of(s)]
    assert model.breakdown(g, ids).redundant_flops == 0
    assert model.latency(g, ids).seconds < split_latency(model, g, ids[:1], ids[1:])


def transpose_reduce_graph(rows: int):
    b = Builder()
    x = b.input((1, rows, 1024))
    t = b.op("Transpose", [x], (1, 1024, rows), SHU, flops=0, attrs={"perm": [0, 2, 1]})
    r = b.op("ReduceSum", [t], (1, 1024, 1), M2M, flops=numel((1, rows, 1024)))
    return b.graph([r]), [b.op_of(t), b.op_of(r)]


def test_shuffle_into_many_to_many_pays_for_strided_access_beyond_l2():
    model = RooflineModel(MACHINE)
    g, ids = transpose_reduce_graph(rows=1024)  # 4 MiB > 1 MiB L2
    parts = model.breakdown(g, ids)
    assert parts.penalty_bytes == (model.shuffle_penalty - 1) * 4 * 1024 * 1024
    assert model.latency(g, ids).seconds > split_latency(model, g, ids[:1], ids[1:])
    g, ids = transpose_reduce_graph(rows=16)  # 64 KiB fits in L2: no penalty, fusion pays off
    assert model.breakdown(g, ids).penalty_bytes == 0
    assert model.latency(g, ids).seconds < split_latency(model, g, ids[:1], ids[1:])


def depthwise_transpose_graph(group: int, perm: list[int]):
    """Depthwise (or grouped) 7×7 conv on [1, 192, 28, 28] (0.6 MB, inside the L2), then a
    Transpose by `perm`; returns (graph, [conv, transpose])."""
    b = Builder()
    shape = (1, 192, 28, 28)
    x = b.input(shape)
    w = b.const(np.zeros((192, 192 // group, 7, 7), np.float32))
    c = b.op("Conv", [x, w], shape, M2M, ci=True, flops=2 * 49 * numel(shape) * 192 // group,
             attrs={"kernel_shape": [7, 7], "pads": [3] * 4, "strides": [1, 1], "group": group})
    out = tuple(shape[i] for i in perm)
    t = b.op("Transpose", [c], out, SHU, flops=0, attrs={"perm": perm})
    return b.graph([t]), [b.op_of(c), b.op_of(t)]


def test_transposing_a_depthwise_convs_channels_innermost_pays_inside_the_l2():
    """A depthwise conv computes one channel plane per task: transposing its result to channels
    last stores each element C floats from the last (ConvNeXt-T's 28×28×192 block ran 5× as long
    fused on a Zen 4), whatever the result's size; other transpositions and other convs don't."""
    model = RooflineModel(MACHINE)
    g, ids = depthwise_transpose_graph(192, [0, 2, 3, 1])
    assert model.breakdown(g, ids).penalty_bytes == 192 * 28 * 28 * 64  # a cache line each
    assert model.latency(g, ids).seconds > split_latency(model, g, ids[:1], ids[1:])
    for group, perm in ((192, [0, 1, 3, 2]), (1, [0, 2, 3, 1]), (2, [0, 2, 3, 1])):
        g, ids = depthwise_transpose_graph(group, perm)
        assert model.breakdown(g, ids).penalty_bytes == 0, (group, perm)


def test_launch_overhead_and_compute_bound_anchor():
    model = RooflineModel(MACHINE)
    b = Builder()
    x = b.input((256, 256))
    w = b.const(np.zeros((256, 256), np.float32))
    mm = b.op("MatMul", [x, w], (256, 256), M2M, ci=True, flops=2 * 256 ** 3)
    g = b.graph([mm])
    parts = model.breakdown(g, [b.op_of(mm)])
    assert parts.launch_s == LAUNCH_OVERHEAD_S
    assert parts.compute_s == pytest.approx(2 * 256 ** 3 / 100e9)
    assert parts.seconds == pytest.approx(max(parts.compute_s, parts.memory_s) + LAUNCH_OVERHEAD_S)


def test_roofline_keeps_no_records():
    g, block = conv_block_graph()
    with pytest.raises(NotImplementedError, match="SQLiteProfileStore"):
        RooflineModel(MACHINE).record(g, block, [1e-3])


# --- SQLite store -----------------------------------------------------------------------------

@pytest.fixture
def db(tmp_path):
    return tmp_path / "profiles.sqlite"


def test_record_then_hit_returns_measured_median(db):
    g, block = conv_block_graph()
    store = SQLiteProfileStore(db, MACHINE)
    store.record(g, block, [1e-6, 2e-6, 3e-6, 4e-6, 100e-6])
    est = store.latency(g, block)
    assert same(est, 3e-6, MEASURED)
    assert (store.hits, store.misses) == (1, 0)
    # The same block in another model (other ids, names, weights) hits the same entry.
    g2, block2 = conv_block_graph("another", weight_seed=7, extra_prefix_ops=2)
    assert store.latency(g2, block2) == est
    assert store.hits == 2


def test_miss_falls_back_to_roofline(db):
    g, block = conv_block_graph()
    store = SQLiteProfileStore(db, MACHINE)
    est = store.latency(g, block)
    assert est.source == COST_MODEL
    assert est == RooflineModel(MACHINE).latency(g, block)
    assert (store.hits, store.misses) == (0, 1)
    store.record(g, block[:2], [5e-6])  # another block: still a miss for the three-op block
    assert store.latency(g, block).source == COST_MODEL
    assert store.misses == 2


def test_custom_fallback_and_predicted_source(db):
    class Fixed:
        def latency(self, graph, op_ids):
            return Estimate(42.0, COST_MODEL)

        def record(self, *a, **k):
            raise AssertionError("the store never records into its fallback")

    g, block = conv_block_graph()
    store = SQLiteProfileStore(":memory:", MACHINE, fallback=Fixed())
    assert store.latency(g, block).seconds == 42.0
    store.record(g, block, [7e-6], source=PREDICTED)
    assert same(store.latency(g, block), 7e-6, PREDICTED)
    # Measured samples outrank predicted ones; the two are not mixed.
    store.record(g, block, [2e-6, 4e-6], source=MEASURED)
    assert same(store.latency(g, block), 3e-6, MEASURED)
    entry = store.entry(g, block)
    assert entry["source"] == MEASURED and entry["n"] == 2
    store.record(g, block, [1e-9], source=PREDICTED)
    assert same(store.latency(g, block), 3e-6, MEASURED)
    with pytest.raises(ValueError, match="source"):
        store.record(g, block, [1e-6], source=COST_MODEL)


def test_repeated_records_merge(db):
    g, block = conv_block_graph()
    store = SQLiteProfileStore(db, MACHINE)
    store.record(g, block, [1e-3, 2e-3, 3e-3], toolchain="gcc-12")
    store.record(g, block, [4e-3, 5e-3])
    assert len(store) == 1
    entry = store.entry(g, block)
    assert entry["n"] == 5 and entry["median_s"] == pytest.approx(3e-3)
    assert entry["p10_s"] == pytest.approx(np.percentile([1, 2, 3, 4, 5], 10) * 1e-3)
    assert entry["p90_s"] == pytest.approx(np.percentile([1, 2, 3, 4, 5], 90) * 1e-3)
    assert entry["schedule"] == "{}" and entry["toolchain"] == "gcc-12"
    assert entry["device_fingerprint"] == MACHINE.fingerprint and entry["created"]


def test_schedules_best_first(db):
    g, block = conv_block_graph()
    store = SQLiteProfileStore(db, MACHINE)
    store.record(g, block, [3e-3], schedule={"tile": 8, "vector": 4})
    store.record(g, block, [1e-3], schedule={"vector": 8, "tile": 16})
    store.record(g, block, [2e-3])
    store.record(g, block, [1e-3, 1e-3], schedule={"tile": 16, "vector": 8})  # same schedule
    assert len(store) == 3
    assert store.schedules(g, block) == [({"tile": 16, "vector": 8}, 1e-3), ({}, 2e-3),
                                         ({"tile": 8, "vector": 4}, 3e-3)]
    assert same(store.latency(g, block), 1e-3, MEASURED)
    with pytest.raises(ValueError, match="schedule"):
        store.record(g, block, [1e-3], schedule=["not", "a", "dict"])


def test_persistence_across_store_objects_and_machines(db):
    g, block = conv_block_graph()
    first = SQLiteProfileStore(db, MACHINE)
    first.record(g, block, [2e-5, 4e-5])
    first.close()
    second = SQLiteProfileStore(db, MACHINE)
    assert same(second.latency(g, block), 3e-5, MEASURED)
    assert len(second) == 1
    other = SQLiteProfileStore(db, OTHER_MACHINE)
    assert other.latency(g, block).source == COST_MODEL and len(other) == 0


def test_schema_indexes_and_wal(db):
    SQLiteProfileStore(db, MACHINE).close()
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    cols = [r[1] for r in conn.execute("PRAGMA table_info(profile_entries)")]
    assert cols == ["id", "device_fingerprint", "signature", "schedule", "median_s", "p10_s",
                    "p90_s", "n", "source", "toolchain", "created"]
    indexed = {tuple(c[2] for c in conn.execute(f"PRAGMA index_info({name!r})"))
               for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'"
                                           " AND tbl_name = 'profile_entries'")}
    assert ("device_fingerprint", "signature") in indexed
    assert ("device_fingerprint", "signature", "median_s") in indexed
    plan = " ".join(str(r) for r in conn.execute(
        "EXPLAIN QUERY PLAN SELECT median_s FROM profile_entries WHERE device_fingerprint = 'a'"
        " AND signature = 'b' ORDER BY median_s LIMIT 1"))
    assert "USING" in plan and "INDEX" in plan


@pytest.mark.parametrize("samples, message", [
    ([1e-3, float("nan")], "NaN"),
    ([-1e-3], "> 0"),
    ([0.0], "> 0"),
    ([float("inf")], "infinite"),
    ([3600.0], "3600"),
    ([], "no latency samples"),
    ([1e-3] * (MAX_SAMPLES + 1), "too many"),
    (["1e-3"], "not a number"),
    ("1e-3", "string"),
    ([True], "not a number"),
    (None, "number"),
])
def test_invalid_samples_are_refused(db, samples, message):
    g, block = conv_block_graph()
    store = SQLiteProfileStore(db, MACHINE)
    with pytest.raises(ValueError, match=message):
        store.record(g, block, samples)
    assert len(store) == 0
    assert store.latency(g, block).source == COST_MODEL


def test_single_number_and_numpy_samples_accepted(db):
    g, block = conv_block_graph()
    store = SQLiteProfileStore(db, MACHINE)
    store.record(g, block, 2e-6)
    store.record(g, block, np.array([4e-6, 6e-6]))
    assert store.entry(g, block)["n"] == 3
    store.record(g, block, [1e-6] * MAX_SAMPLES)  # the limit itself is fine
    assert store.entry(g, block)["n"] == MAX_SAMPLES  # only the most recent are kept


def _writer(path: str, worker: int, rounds: int) -> None:
    g, block = conv_block_graph()
    store = SQLiteProfileStore(path, MACHINE)
    for i in range(rounds):
        store.record(g, block, [(worker + 1) * 1e-6])  # one shared entry
        store.record(g, block, [1e-6 * (i + 1)], schedule={"worker": worker, "i": i})
    store.close()


def test_concurrent_writers_lose_nothing(db):
    rounds = 40
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(db), w, rounds)) for w in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    g, block = conv_block_graph()
    store = SQLiteProfileStore(db, MACHINE)
    assert len(store) == 1 + 2 * rounds
    shared = store.entry(g, block)
    assert shared["n"] == 2 * rounds
    assert shared["median_s"] == pytest.approx(1.5e-6)
    conn = sqlite3.connect(db)
    assert conn.execute("SELECT COUNT(*) FROM profile_samples").fetchone()[0] == 4 * rounds


# --- machine facts ----------------------------------------------------------------------------

@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    machine_mod._memo.clear()
    yield tmp_path / "cache"
    machine_mod._memo.clear()


def test_host_machine_measures_once_and_caches(cache, monkeypatch):
    calls = []

    def fake_measure(l3_bytes=None):
        calls.append(l3_bytes)
        return 123.0, 45.0

    monkeypatch.setattr(machine_mod, "measure", fake_measure)
    facts = host_machine()
    assert len(calls) == 1
    assert (facts.peak_gflops, facts.bandwidth_gbs) == (123.0, 45.0)
    files = list(cache.iterdir())
    assert [f.name for f in files] == [f"machine-{facts.fingerprint}.json"]  # no temp file left
    stored = json.loads(files[0].read_text())["facts"]
    assert MachineFacts.from_dict(stored) == facts

    assert host_machine() is facts  # in-process memo
    machine_mod._memo.clear()  # as a new process would start
    assert host_machine() == facts
    assert len(calls) == 1
    host_machine(refresh=True)
    assert len(calls) == 2


def test_corrupt_cache_is_measured_over(cache, monkeypatch):
    monkeypatch.setattr(machine_mod, "measure", lambda l3_bytes=None: (10.0, 5.0))
    facts = host_machine()
    path = cache / f"machine-{facts.fingerprint}.json"
    path.write_text("{not json")
    machine_mod._memo.clear()
    monkeypatch.setattr(machine_mod, "measure", lambda l3_bytes=None: (11.0, 6.0))
    assert host_machine().peak_gflops == 11.0
    assert json.loads(path.read_text())["facts"]["peak_gflops"] == 11.0


def test_later_process_reuses_cache(cache, monkeypatch):
    monkeypatch.setattr(machine_mod, "measure", lambda l3_bytes=None: (77.0, 7.0))
    facts = host_machine()
    code = ("import kiln.profile.machine as m\n"
            "def boom(*a, **k): raise SystemExit('measured again')\n"
            "m.measure = boom\n"
            "print(m.host_machine().peak_gflops)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "KILN_CACHE_DIR": str(cache)}, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert float(out.stdout) == facts.peak_gflops == 77.0


def test_static_facts_and_fingerprint():
    static = machine_mod.static_facts()
    assert static["logical_cores"] >= 1 and static["cpu_model"]
    assert set(static["isa"]) <= set(machine_mod.ISA_FEATURES)
    assert static == machine_mod.static_facts()
    assert MACHINE.fingerprint == replace(MACHINE, peak_gflops=1.0).fingerprint  # hardware only
    assert MACHINE.fingerprint != OTHER_MACHINE.fingerprint
    assert MACHINE.fingerprint != replace(MACHINE, l2_bytes=2 << 20).fingerprint
    assert len(MACHINE.fingerprint) == 16


def test_measure_is_quick_and_positive():
    start = time.perf_counter()
    gflops, gbs = machine_mod.measure(32 << 20)
    assert time.perf_counter() - start < 2.0
    assert gflops > 0 and gbs > 0 and math.isfinite(gflops) and math.isfinite(gbs)


def test_default_store_uses_env_path(cache, tmp_path, monkeypatch):
    from kiln.profile.local import default_store

    monkeypatch.setattr(machine_mod, "measure", lambda l3_bytes=None: (50.0, 10.0))
    db = tmp_path / "deep" / "dir" / "p.sqlite"
    monkeypatch.setenv("KILN_PROFILE_DB", str(db))
    store = default_store()
    assert db.exists() and store.machine == host_machine()
    g, block = conv_block_graph()
    store.record(g, block, [1e-6])
    store.close()
    monkeypatch.delenv("KILN_PROFILE_DB")
    other = default_store()
    assert Path(other.path) == cache / "profiles.sqlite" and len(other) == 0
    assert same(default_store(db).latency(g, block), 1e-6, MEASURED)


def test_library_imports_no_service_packages():
    code = ("import sys, kiln.signature, kiln.profile.local\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in "
            "{'fastapi', 'sqlalchemy', 'celery', 'redis', 'psycopg', 'psycopg2', 'pydantic',"
            " 'starlette', 'alembic'}]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True,
                   cwd=Path(__file__).resolve().parents[1])


def test_missing_folder_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        SQLiteProfileStore(tmp_path / "nowhere" / "p.sqlite", MACHINE)


# --- the protocol -----------------------------------------------------------------------------

def test_the_shipped_stores_declare_the_whole_protocol():
    from kiln.profile import ProfileStore, check_store

    g, block = conv_block_graph()
    sqlite_store = SQLiteProfileStore(":memory:", MACHINE)
    model = RooflineModel(MACHINE)
    for store in (sqlite_store, model):
        assert isinstance(store, ProfileStore) and check_store(store) is store
    assert isinstance(sqlite_store.fallback, RooflineModel)
    assert model.fallback is None and model.schedules(g, block) == []
    with pytest.raises(NotImplementedError, match="cost model"):
        model.record(g, block, [1e-6], MEASURED, schedule={"vector": 8})


def test_a_store_lacking_part_of_the_protocol_is_refused_by_name(tmp_path):
    from kiln.pipeline import CompileOptions, compile_model

    class LatencyOnly:
        def latency(self, graph, op_ids):
            return Estimate(1e-6, COST_MODEL)

    with pytest.raises(TypeError, match="LatencyOnly is not a kiln.profile.ProfileStore: it "
                                        "lacks fallback, record, schedules"):
        compile_model("tests/fixtures/zoo/resnet50.onnx", CompileOptions(), LatencyOnly())
