"""Probe artifacts: blocks cut out of their models keep their signatures and build side by side."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.pipeline import CompileOptions, compile_model
from kiln.profile.machine import host_machine
from kiln.measure.probe import ProbeError, build_probes, make_probe
from kiln.profile.roofline import RooflineModel
from kiln.runtime.artifact import read_manifest
from kiln.signature import kernel_signature
from tests.runtime.conftest import kiln_cache  # noqa: F401  (autouse: a private build cache)

ZOO = "tests/fixtures/zoo"


@pytest.fixture(scope="module")
def tinybert():
    return compile_model(f"{ZOO}/tinybert.onnx", CompileOptions(), RooflineModel(host_machine()))


def test_probes_keep_their_signatures_and_share_an_artifact(tinybert, tmp_path):
    graph = tinybert.graph
    blocks = [b for b in tinybert.plan.blocks if not b.is_view]
    probes = [make_probe(graph, b.op_ids) for b in blocks]
    probes += [make_probe(graph, blocks[0].op_ids, {"parallel_min_work": 1 << 20}),
               make_probe(graph, blocks[0].op_ids, {"no_such_field": 1}),
               make_probe(graph, blocks[0].op_ids)]  # the same kernel twice
    assert [p.signature for p in probes[:len(blocks)]] == [
        kernel_signature(graph, b.op_ids) for b in blocks]
    built = build_probes(probes, __import__("kiln.target").target.target("host"),
                         tmp_path / "probes.kiln")
    reasons = dict(built.skipped)
    assert "unknown schedule parameter" in reasons[len(blocks) + 1]
    assert reasons[len(blocks) + 2].startswith("same code as probe 0")
    signatures = {(k["signature"], k["schedule"]) for k in built.kernels.values()}
    assert {(p.signature, p.schedule_text) for p in probes[:len(blocks)]} <= signatures
    manifest = read_manifest(built.path)
    assert {k["block"] for k in manifest["kernels"]} == set(built.kernels)
    assert "gcc" in built.toolchain or "clang" in built.toolchain
    # Model names never reach the probe: its tensors are Kiln's ids under a p<i>_ prefix.
    assert all(t["name"].startswith(("p", "w")) for t in manifest["inputs"])


def test_large_float_constants_are_shared_and_small_ones_kept(tinybert):
    from kiln.measure.probe import _Merger

    graph = tinybert.graph
    block = next(b for b in tinybert.plan.blocks if any(
        graph.op_by_id[i].op_type == "MatMul" for i in b.op_ids))
    merger = _Merger()
    ops = merger.add(0, make_probe(graph, block.op_ids))
    merger.add(1, make_probe(graph, block.op_ids))
    copied = merger.graph(graph.opset)
    for op_id in ops:
        original = graph.op_by_id[op_id[len("p0_"):]]
        for mine, theirs in zip(copied.op_by_id[op_id].inputs, original.inputs):
            if theirs is None or not graph.tensor(theirs).is_constant:
                continue
            data, kept = graph.tensor(theirs).data, copied.tensor(mine).data
            assert kept.shape == data.shape and kept.dtype == data.dtype
            if data.dtype.kind == "f" and data.nbytes > 4096:
                assert mine.startswith("w")  # shared between the two probes
            else:
                assert np.array_equal(kept, data)  # shapes, indices, scalars: the real values


def test_blocks_with_subgraphs_are_refused():
    from tests.graphs import ecg

    body = ecg([("Relu", ["a"], ["b"])], {"a": (2,), "b": (2,)}, ["a"], ["b"])
    graph = ecg([("If", ["c"], ["y"])], {"c": (), "y": (2,)}, ["c"], ["y"])
    op = graph.ops[0]
    op.attrs["then_branch"] = body
    with pytest.raises(ProbeError, match="subgraph"):
        make_probe(graph, [op.id])
