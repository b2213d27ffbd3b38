"""The committed tiny zoo models load, validate, run, and re-export identically."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from bench.zoo import MODELS, REPO_ROOT, input_specs, make_inputs, model_path, output_specs

MAX_FIXTURE_BYTES = 1_000_000
ONNX_ELEM_TYPES = {"float32": onnx.TensorProto.FLOAT, "int64": onnx.TensorProto.INT64}


def _value_info_signature(values: list[onnx.ValueInfoProto]) -> list[tuple[str, tuple[int, ...], int]]:
    signature = []
    for value in values:
        tensor_type = value.type.tensor_type
        shape = tuple(dim.dim_value for dim in tensor_type.shape.dim)
        signature.append((value.name, shape, tensor_type.elem_type))
    return signature


def _spec_signature(name: str, io: str) -> list[tuple[str, tuple[int, ...], int]]:
    specs = input_specs(name, "tiny") if io == "inputs" else output_specs(name, "tiny")
    return [(spec.name, spec.shape, ONNX_ELEM_TYPES[spec.dtype]) for spec in specs]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fixture_is_small_and_valid(name: str) -> None:
    path = model_path(name, "tiny")
    assert path.stat().st_size < MAX_FIXTURE_BYTES
    model = onnx.load(str(path))
    onnx.checker.check_model(model)
    assert max(opset.version for opset in model.opset_import if opset.domain in ("", "ai.onnx")) >= 14
    assert _value_info_signature(list(model.graph.input)) == _spec_signature(name, "inputs")
    assert _value_info_signature(list(model.graph.output)) == _spec_signature(name, "outputs")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fixture_runs_with_random_inputs(name: str) -> None:
    session = ort.InferenceSession(str(model_path(name, "tiny")), providers=["CPUExecutionProvider"])
    specs = output_specs(name, "tiny")
    outputs = session.run([spec.name for spec in specs], make_inputs(name, "tiny", seed=1))
    for spec, value in zip(specs, outputs, strict=True):
        assert value.shape == spec.shape, spec.name
        assert value.dtype == np.dtype(spec.dtype), spec.name
        assert np.all(np.isfinite(value)), spec.name


def test_token_inputs_stay_in_vocab() -> None:
    for name in MODELS:
        for spec in input_specs(name, "tiny"):
            value = make_inputs(name, "tiny")[spec.name]
            if spec.kind == "token_ids":
                assert spec.vocab_size is not None
                assert 0 <= value.min() and value.max() < spec.vocab_size


def test_reexport_reproduces_committed_fixture(tmp_path: Path) -> None:
    """Re-exporting with the CLI gives the same graph and initializer values."""
    name = "tinybert"
    command = [sys.executable, str(REPO_ROOT / "bench" / "zoo.py"), "--size", "tiny", "--models", name]
    subprocess.run([*command, "--out", str(tmp_path)], check=True, capture_output=True)
    fresh = onnx.load(str(model_path(name, "tiny", tmp_path)))
    committed = onnx.load(str(model_path(name, "tiny")))
    # Graph equality covers nodes, attributes and initializer bytes; producer metadata may differ.
    assert fresh.graph == committed.graph
    assert fresh.opset_import == committed.opset_import
