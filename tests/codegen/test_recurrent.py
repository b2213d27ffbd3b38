"""LSTM, GRU and RNN against onnxruntime: hidden sizes that are not a whole number of unit blocks
(the step loop runs over blocks of 16 to 64 units), batches, directions, sequence lengths, initial
states, peepholes, clipping, and R as a constant (packed at compile time) or an input.
onnxruntime runs no batch-first layout (layout=1), so these cover the sequence-first one."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper

from tests.codegen.harness import check_model, model, random_inputs

GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}


def recurrent_model(op: str, hidden: int, batch: int, seq: int, direction: str,
                    constant_r: bool, lens: bool, initial: bool, extras: dict, seed: int = 0):
    rng = np.random.default_rng(seed)
    dirs = 2 if direction == "bidirectional" else 1
    gates, features = GATES[op], 3
    state_shape = (dirs, batch, hidden)
    spec = {"x": ((seq, batch, features), "float32")}
    r = (rng.standard_normal((dirs, gates * hidden, hidden)) * 0.3).astype(np.float32)
    inits = {"w": (rng.standard_normal((dirs, gates * hidden, features)) * 0.5).astype(np.float32),
             "b": (rng.standard_normal((dirs, 2 * gates * hidden)) * 0.1).astype(np.float32)}
    if constant_r:
        inits["r"] = r
    else:
        spec["r"] = (r.shape, "float32")
    names = ["x", "w", "r", "b", "", "", "", ""]
    if lens:
        inits["lens"] = rng.integers(1, seq + 1, size=batch).astype(np.int32)
        names[4] = "lens"
    if initial:
        spec["h0"] = (state_shape, "float32")
        names[5] = "h0"
        if op == "LSTM":
            spec["c0"] = (state_shape, "float32")
            names[6] = "c0"
    if op == "LSTM" and extras.pop("peepholes", False):
        inits["p"] = (rng.standard_normal((dirs, 3 * hidden)) * 0.3).astype(np.float32)
        names[7] = "p"
    while names[-1] == "":
        names.pop()
    outputs = ["y", "yh", "yc"] if op == "LSTM" else ["y", "yh"]
    node = helper.make_node(op, names, outputs, hidden_size=hidden, direction=direction,
                            **extras)
    inputs = random_inputs(spec, seed)
    if not constant_r:
        inputs["r"] = r
    return model([node], spec, outputs, inits, opset=14), inputs


@settings(max_examples=30, deadline=None)
@given(op=st.sampled_from(sorted(GATES)), hidden=st.integers(1, 37), batch=st.integers(1, 3),
       seq=st.integers(1, 5), direction=st.sampled_from(["forward", "reverse", "bidirectional"]),
       constant_r=st.booleans(), lens=st.booleans(), initial=st.booleans(),
       variant=st.integers(0, 3))
def test_recurrent_matches_onnxruntime(op, hidden, batch, seq, direction, constant_r, lens,
                                       initial, variant):
    extras: dict = {}
    if op == "GRU":
        extras["linear_before_reset"] = variant % 2
    if op == "LSTM":
        extras["peepholes"] = variant % 2 == 1
        if variant == 2:
            extras["input_forget"] = 1
    if variant == 3:
        extras["clip"] = 0.7
    m, inputs = recurrent_model(op, hidden, batch, seq, direction, constant_r, lens, initial,
                                extras)
    check_model(m, inputs, ["none"])


def test_parallel_steps_over_a_partial_unit_block():
    """Hidden 100 and batch 2: enough work for the step's parallel loop, blocks of units with a
    partial last one (100 is no multiple of 16, 32 or 64), the hidden state double-buffered
    across threads."""
    for op, extras in (("LSTM", {"peepholes": True}), ("GRU", {"linear_before_reset": 0}),
                       ("GRU", {"linear_before_reset": 1}), ("RNN", {})):
        for constant_r in (True, False):
            m, inputs = recurrent_model(op, 100, 2, 6, "bidirectional", constant_r, True, True,
                                        dict(extras))
            check_model(m, inputs, ["none"])


def test_lstm_clip_bounds_the_activation_input_with_the_peephole_term():
    """ONNX clips the input of the activations: x·W + h·R + biases + P ⊙ c, not the sum
    before the peephole term is added."""
    m, inputs = recurrent_model("LSTM", 5, 2, 3, "forward", True, False, False,
                                {"peepholes": True, "clip": 0.7})
    check_model(m, inputs, ["none"])
