"""The tiny zoo, rewritten: every model's outputs are unchanged (onnxruntime on the exported
rewritten ECG against onnxruntime on the original model, within `kiln verify`'s tolerance), and
rewriting lowers the FLOPs of every transformer."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from bench.zoo import MODELS, input_specs
from kiln import frontend
from kiln.rewrite import rewrite
from kiln.rewrite.export import run_onnxruntime
from kiln.runtime.cli import compare

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "zoo"
TRANSFORMERS = ("albert", "bert-base", "distilbert", "gpt2", "mobilebert", "tinybert", "vit-base")


def realistic_inputs(name: str, size: str = "tiny", seed: int = 0) -> dict[str, np.ndarray]:
    """Token ids in [0, 100), attention masks of ones, standard normal floats."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for spec in input_specs(name, size):
        if spec.kind == "token_ids":
            feeds[spec.name] = rng.integers(0, 100, spec.shape).astype(spec.dtype)
        elif spec.kind == "mask":
            feeds[spec.name] = np.ones(spec.shape, spec.dtype)
        else:
            feeds[spec.name] = rng.standard_normal(spec.shape).astype(spec.dtype)
    return feeds


@pytest.mark.parametrize("name", sorted(MODELS))
def test_zoo_outputs_are_unchanged_by_rewriting(name):
    path = FIXTURES / f"{name}.onnx"
    feeds = realistic_inputs(name)
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
