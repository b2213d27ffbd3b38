"""Fused attention (`kiln.codegen.ops.fused_attention`): MatMul → scale/bias/mask → Softmax →
MatMul chains, recognised from the graph, planned as one block by dnnfusion and lowered as one
stage, against onnxruntime on random shapes: heads, sequence lengths that are not multiples of the
vector width, head sizes, masks (additive, boolean, causal) and none."""
from __future__ import annotations

import pytest

from kiln import frontend
from kiln.codegen import generate
from kiln.plan.chains import attention_chains
from bench.attention import ADDITIVE, BIAS, BOOLEAN, CAUSAL, attention_model
from kiln.target import host_target
from tests.codegen.harness import assert_matches, plan_for, reference, run_kernels


def fused_stages(kernels) -> list[dict]:
    return [s for k in kernels for s in k.schedule["stages"] if s.get("form") == "fused attention"]


CASES = [  # batch, heads, q_len, kv_len, head, value, mask, packed_q, transpose_k
    (1, 2, 7, 7, 8, 8, None, False, False),
    (2, 3, 49, 49, 32, 32, BIAS, True, False),  # Swin windows: a relative-position bias
    (1, 4, 37, 53, 16, 24, BOOLEAN, False, True),  # lengths off the vector width
    (1, 2, 33, 33, 64, 64, CAUSAL, True, True),  # GPT-2: causal mask, K transposed in the graph
    (1, 1, 70, 19, 5, 3, ADDITIVE, False, False),  # several row tiles, odd head sizes
    (3, 1, 1, 17, 8, 8, None, False, False),  # one query row (decoding)
    (1, 2, 20, 300, 8, 8, ADDITIVE, True, False),  # many keys: row tiles of one micro-tile
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
