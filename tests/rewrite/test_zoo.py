"""The tiny zoo, rewritten: every model's outputs are unchanged (onnxruntime on the exported
rewritten ECG against onnxruntime on the original model, within `kiln verify`'s tolerance), and
rewriting lowers the FLOPs of every transformer."""
from __future__ import annotations

from pathlib import Path

import onnxruntime as ort
import pytest

from bench.zoo import MODELS, make_inputs
from kiln import frontend
from kiln.rewrite import rewrite
from kiln.rewrite.export import run_onnxruntime
from kiln.runtime.cli import compare

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "zoo"
TRANSFORMERS = ("albert", "bert-base", "distilbert", "gpt2", "mobilebert", "tinybert", "vit-base")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_zoo_outputs_are_unchanged_by_rewriting(name):
    path = FIXTURES / f"{name}.onnx"
    feeds = make_inputs(name, "tiny")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    want = session.run(None, feeds)
    graph = frontend.load(path)
    result = rewrite(graph)
    by_name = {graph.tensors[t].source_name: t for t in graph.inputs}
    got = run_onnxruntime(result.graph, {by_name[k]: v for k, v in feeds.items()})
    rows = [compare(o.name, g, w) for o, g, w in zip(session.get_outputs(), got, want)]
    assert all(r["ok"] for r in rows), rows
    if name in TRANSFORMERS:
        assert result.flops_after < result.flops_before
        assert result.rules_fired
