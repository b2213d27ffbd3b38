"""Every rule, on random shapes and values: the pattern and its replacement evaluate to the same
outputs under onnx's ReferenceEvaluator, and the rewritten graph is a valid ECG.

`test_rule_preserves_values` draws instances the rule is meant for; `test_guard_is_sound` draws
adversarial ones (other dtypes, constants that broadcast the operand, zero or negative constants,
unrelated attributes) and checks that whenever the guard lets the rule apply, the values still
agree; `test_rule_applies_to_its_examples` makes sure the first test is not vacuous.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, find, given, settings, strategies as st

from kiln.rewrite import all_rules, apply_once
from tests.rewrite.examples import draw_instance
from tests.rewrite.harness import Skip, assert_close, check_ecg, evaluate

RULES = all_rules()
SETTINGS = settings(max_examples=8, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])


def _instance(data, rule, wild: bool):
    try:
        return draw_instance(data.draw, rule, wild)
    except Skip:
        assume(False)


def _root(graph):
    return next(op.id for op in graph.ops if graph.outputs[0] in op.outputs)


def _reference(graph, feeds):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return evaluate(graph, feeds)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
@SETTINGS
@given(data=st.data())
def test_rule_preserves_values(rule, data):
    inst = _instance(data, rule, wild=False)
    after = apply_once(inst.graph, rule, at=_root(inst.graph))
    assume(after is not None)  # the guard refused this draw (counted in the test below)
    check_ecg(inst.graph, after)
    assert_close(_reference(after, inst.feeds), _reference(inst.graph, inst.feeds))


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
@SETTINGS
@given(data=st.data())
def test_guard_is_sound(rule, data):
    inst = _instance(data, rule, wild=True)
    try:
        want = _reference(inst.graph, inst.feeds)
    except Exception:  # the reference evaluator has no kernel for this dtype combination
        assume(False)
    assume(all(np.all(np.isfinite(w)) for w in want if w.dtype.kind == "f"))
    after = apply_once(inst.graph, rule, at=_root(inst.graph))
    assume(after is not None)
    check_ecg(inst.graph, after)
    assert_close(_reference(after, inst.feeds), want)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_rule_applies_to_its_examples(rule):
    def applies(data) -> bool:
        try:
            inst = draw_instance(data.draw, rule, wild=False)
        except Skip:
            return False
        return apply_once(inst.graph, rule, at=_root(inst.graph)) is not None

    find(st.data(), applies, settings=settings(max_examples=60, database=None, deadline=None,
                                               derandomize=True,
                                               suppress_health_check=list(HealthCheck)))
