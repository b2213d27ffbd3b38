"""The backend seam: a target names its backend; a renderer is the C-family printer plus a few
overrides, and the IR it prints already has its common sub-expressions named."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from onnx import helper

from kiln import frontend
from kiln.codegen import backend as backends
from kiln.codegen import generate, ir
from kiln.codegen.expr import add, binary, iconst, load, mul, var
from kiln.codegen.passes import bind_values
from kiln.codegen.render.c import CRenderer
from kiln.codegen.render.cstyle import CStyleRenderer
from kiln.errors import KilnError
from kiln.target import target
from tests.codegen.harness import assert_matches, model, plan_for, reference, run_kernels

SPEC = {"x": ((96, 128), "float32")}


class SerialC(CRenderer):
    """C without threads or vector pragmas: the overrides are how a parallel nest and a vector
    loop are mapped."""

    def parallel_loop(self, loop: ir.Loop) -> list[str]:
        return []

    def outlined_loop(self, loop: ir.Loop) -> list[str]:
        return CStyleRenderer.loop(self, loop)


def _model():
    rng = np.random.default_rng(0)
    inits = {"w": rng.standard_normal((128, 256)).astype(np.float32),
             "b": rng.standard_normal(256).astype(np.float32)}
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["a"]),
             helper.make_node("Softmax", ["a"], ["y"], axis=-1)]
    return model(nodes, SPEC, ["y"], inits)


def test_a_target_naming_an_unknown_backend_is_refused_by_name():
    graph = frontend.build(_model(), {}, "t")
    with pytest.raises(KilnError, match="backend 'metal'"):
        generate(plan_for(graph, "none"), replace(target("x86_64"), backend="metal"))


def test_a_renderer_subclass_changes_only_what_it_overrides(monkeypatch):
    m = _model()
    graph = frontend.build(m, {}, "t")
    plan = plan_for(graph, "dnnfusion")
    serial = replace(backends.C_OPENMP, name="c-serial", renderer=SerialC)
    monkeypatch.setitem(backends.BACKENDS, "c-serial", serial)
    host = target("host")
    pooled = generate(plan, host)
    plain = generate(plan, replace(host, backend="c-serial"))
    assert any("kiln_parallel_for(" in k.source for k in pooled)
    for k in plain:
        assert "#pragma omp" not in k.source and "kiln_parallel_for(" not in k.source
        assert "pthread" not in k.source  # the pool comes only with a parallel loop
    inputs = {"x": np.random.default_rng(1).standard_normal(SPEC["x"][0]).astype(np.float32)}
    for kernels in (pooled, plain):
        values = run_kernels(plan, kernels, dict(zip(graph.inputs, inputs.values())))
        assert_matches([values[t] for t in graph.outputs], reference(m, inputs))


def test_values_are_named_once_at_the_outermost_loop_where_they_are_invariant():
    i, j = var("i", 4), var("j", 8)
    bias, x = load("b", "float32", i), load("x", "float32", add(mul(i, 8), j))
    scaled = binary("mul", bias, bias)
    inner = ir.Loop(j, iconst(0), iconst(8), [ir.Store("y", add(mul(i, 8), j), binary("add", scaled, x)),
                                               ir.Store("z", add(mul(i, 8), j), scaled)])
    kernel = ir.KernelIR("k0_t", [], [ir.Stage("t", [ir.Loop(i, iconst(0), iconst(4), [inner])])])
    bind_values(kernel)
    (outer,) = kernel.stages[0].body
    *hoisted, loop = outer.body
    assert [let.value.op for let in hoisted] == ["load", "mul"]  # b[i] and b[i]·b[i], outside j
    assert loop.body[-1].value is hoisted[1].local  # the second use reads the same name
    names = [s.local.name for s in ir.iter_stmts(kernel.stages[0].body) if isinstance(s, ir.Let)]
    assert len(names) == len(set(names))
