"""Every tiny zoo fixture, end to end through the generated kernels of each partitioner's plan,
against onnxruntime on the original model."""
from __future__ import annotations

from pathlib import Path

import onnx
import pytest

from kiln import frontend
from tests.codegen.check_zoo import model_inputs
from tests.codegen.harness import PARTITIONERS, assert_matches, reference, run_graph

FIXTURES = sorted((Path(__file__).resolve().parents[1] / "fixtures" / "zoo").glob("*.onnx"))


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_tiny_zoo_model(path: Path) -> None:
    model = onnx.load(str(path))
    inputs = model_inputs(model)
    want = reference(model, inputs)
    graph = frontend.load(path, {n: v.shape for n, v in inputs.items()})
    for name in PARTITIONERS:
        assert_matches(run_graph(graph, name, inputs), want, f"{path.stem} [{name}]")
