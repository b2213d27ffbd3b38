"""Fused attention (`kiln.codegen.ops.fused_attention`): MatMul → scale/bias/mask → Softmax →
MatMul chains, recognised from the graph, planned as one block by dnnfusion and lowered as one
stage, against onnxruntime on random shapes: heads, sequence lengths that are not multiples of the
vector width, head sizes, masks (additive, boolean, causal) and none."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from kiln import frontend
from kiln.codegen import generate
from kiln.plan.chains import attention_chains
from kiln.target import host_target
from tests.codegen.harness import assert_matches, model, plan_for, reference, run_kernels

CAUSAL = "causal"


def attention_model(batch: int, heads: int, q_len: int, kv_len: int, head: int, value: int,
                    mask: str | None, packed_q: bool, transpose_k: bool, seed: int = 0,
                    outputs: tuple[str, ...] = ("y",)):
    """(model, inputs): Q either [B, H, Lq, D] or packed [B, Lq, H·D] (Reshape + Transpose in the
    graph, as BERT exports it); K either Kᵀ [B, H, D, Lk] or K [B, H, Lk, D] with a Transpose;
    scores scaled by 1/√D, then the mask, Softmax, ·V [B, H, Lk, Dv], and the output as
    [B, Lq, H·Dv]."""
    rng = np.random.default_rng(seed)
    spec, inits, nodes = {}, {}, []
    if packed_q:
        spec["x"] = ((batch, q_len, heads * head), "float32")
        inits["qshape"] = np.array([batch, q_len, heads, head], np.int64)
        nodes += [helper.make_node("Reshape", ["x", "qshape"], ["q4"]),
                  helper.make_node("Transpose", ["q4"], ["q"], perm=[0, 2, 1, 3])]
    else:
        spec["q"] = ((batch, heads, q_len, head), "float32")
    if transpose_k:
        spec["k"] = ((batch, heads, kv_len, head), "float32")
        nodes.append(helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]))
    else:
        spec["kt"] = ((batch, heads, head, kv_len), "float32")
    spec["v"] = ((batch, heads, kv_len, value), "float32")
    inits["scale"] = np.array(1 / np.sqrt(head), np.float32)
    nodes += [helper.make_node("MatMul", ["q", "kt"], ["s"]),
              helper.make_node("Mul", ["s", "scale"], ["scaled"])]
    scores = "scaled"
    if mask == "additive":
        spec["m"] = ((batch, 1, 1, kv_len), "float32")
        nodes.append(helper.make_node("Add", ["scaled", "m"], ["masked"]))
        scores = "masked"
    elif mask == "boolean":
        spec["keep"] = ((batch, 1, q_len, kv_len), "bool")
        inits["low"] = np.array(-1e9, np.float32)
        nodes.append(helper.make_node("Where", ["keep", "scaled", "low"], ["masked"]))
        scores = "masked"
    elif mask == CAUSAL:
        allowed = np.tril(np.ones((q_len, kv_len), bool), kv_len - q_len)
        inits["causal"] = np.where(allowed, 0, -np.inf).astype(np.float32)[None, None]
        nodes.append(helper.make_node("Add", ["scaled", "causal"], ["masked"]))
        scores = "masked"
    inits["oshape"] = np.array([batch, q_len, heads * value], np.int64)
    nodes += [helper.make_node("Softmax", [scores], ["p"], axis=-1),
              helper.make_node("MatMul", ["p", "v"], ["o"]),
              helper.make_node("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["ot", "oshape"], ["y"])]
    inputs = {}
    for name, (shape, dtype) in spec.items():
        inputs[name] = (rng.random(shape) < 0.8 if dtype == "bool"
                        else rng.standard_normal(shape).astype(dtype))
    if mask == "additive":
        inputs["m"] = np.where(rng.random(inputs["m"].shape) < 0.2, -1e4, 0).astype(np.float32)
    return model(nodes, spec, outputs, inits, opset=17), inputs


def fused_stages(kernels) -> list[dict]:
    return [s for k in kernels for s in k.schedule["stages"] if s.get("form") == "fused attention"]


CASES = [  # batch, heads, q_len, kv_len, head, value, mask, packed_q, transpose_k
    (1, 2, 7, 7, 8, 8, None, False, False),
    (2, 3, 49, 49, 32, 32, "additive", True, False),  # a Swin window, batch of windows
    (1, 4, 37, 53, 16, 24, "boolean", False, True),  # lengths off the vector width
    (1, 2, 33, 33, 64, 64, CAUSAL, True, True),  # GPT-2: causal mask, K transposed in the graph
    (1, 1, 70, 19, 5, 3, "additive", False, False),  # several row tiles, odd head sizes
    (3, 1, 1, 17, 8, 8, None, False, False),  # one query row (decoding)
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:6])) + f"-{c[6]}")
def test_fused_attention_matches_onnxruntime(case):
    onnx_model, inputs = attention_model(*case)
    graph = frontend.build(onnx_model, {}, "attention")
    plan = plan_for(graph, "dnnfusion")
    chains = attention_chains(graph)
    assert len(chains) == 1
    assert any(set(chains[0].op_ids) <= set(b.op_ids) for b in plan.blocks)
    kernels = generate(plan, host_target())
    assert len(fused_stages(kernels)) == 1
    values = run_kernels(plan, kernels, dict(zip(graph.inputs, inputs.values())))
    assert_matches([values[t] for t in graph.outputs], reference(onnx_model, inputs))


@pytest.mark.parametrize("also_read", ["s", "p"])
def test_a_chain_whose_scores_are_read_elsewhere_is_no_chain(also_read):
    onnx_model, inputs = attention_model(1, 2, 8, 8, 8, 8, None, False, False,
                                         outputs=("y", also_read))
    graph = frontend.build(onnx_model, {}, "attention")
    assert attention_chains(graph) == []
    plan = plan_for(graph, "dnnfusion")
    kernels = generate(plan, host_target())
    assert fused_stages(kernels) == []
    values = run_kernels(plan, kernels, dict(zip(graph.inputs, inputs.values())))
    assert_matches([values[t] for t in graph.outputs], reference(onnx_model, inputs))
