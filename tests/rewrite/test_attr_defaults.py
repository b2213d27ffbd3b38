"""Rules read attribute defaults from ONNX's schemas at the model's opset: Softmax's axis is 1
before opset 13 (and normalises every axis from it on), -1 from opset 13."""
from __future__ import annotations

import numpy as np
import onnxruntime
import pytest
from onnx import helper, numpy_helper

from kiln import frontend
from kiln.rewrite import rewrite
from tests.graphs import float_input, save_model


def _softmax_of_shift(tmp_path, opset: int, shift_shape: tuple[int, ...]):
    shift = numpy_helper.from_array(
        np.arange(np.prod(shift_shape), dtype=np.float32).reshape(shift_shape), "v")
    nodes = [helper.make_node("Add", ["x", "v"], ["h"]), helper.make_node("Softmax", ["h"], ["y"])]
    return save_model(tmp_path / f"softmax{opset}.onnx", nodes, [float_input("x", (2, 3, 4))],
                      [float_input("y", (2, 3, 4))], [shift], opset=opset)


@pytest.mark.parametrize("opset, shift_shape, removable", [
    (11, (1, 3, 1), False),  # legacy softmax normalises axes 1 and 2 together: v varies there
    (11, (2, 1, 1), True),   # constant over each normalised row
    (13, (1, 3, 1), True),   # only the last axis is normalised, v is constant along it
    (13, (1, 1, 4), False),
])
def test_softmax_shift_is_removed_only_where_softmax_ignores_it(tmp_path, opset, shift_shape,
                                                                 removable):
    path = _softmax_of_shift(tmp_path, opset, shift_shape)
    result = rewrite(frontend.load(path))
    assert ("softmax_shift" in result.rules_fired) == removable
    # the expectation itself, from onnxruntime at the model's opset: softmax(x + v) == softmax(x)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    v = np.arange(np.prod(shift_shape), dtype=np.float32).reshape(shift_shape)
    with_shift, without = (session.run(None, {"x": feed})[0] for feed in (x, x - v))
    assert np.allclose(with_shift, without, atol=1e-6) == removable
