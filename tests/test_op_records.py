"""One record per op: every op the code generator lowers has a complete record, every property of
an op is decided by the registry (no list of op names elsewhere in kiln/), and attribute defaults
come from ONNX's schemas at the model's opset."""
from __future__ import annotations

import ast
import dataclasses
from collections.abc import Mapping
from pathlib import Path

import onnx.defs
import pytest
from onnx import AttributeProto

from kiln import ops
from kiln.codegen.ops import registered
from kiln.mapping import MappingType
from kiln.ops import ANY_TEXT, OpInfo, attr_default, known_ops, op_info

ROOT = Path(__file__).resolve().parents[1]
ONNX_OPS = frozenset(s.name for s in onnx.defs.get_all_schemas_with_history() if s.domain == "")
STRING_TYPES = (AttributeProto.STRING, AttributeProto.STRINGS)


# --- complete records ------------------------------------------------------------------------------

def test_no_field_of_a_record_has_a_default():
    """A registration must state every fact: a new op cannot inherit one silently."""
    defaulted = [f.name for f in dataclasses.fields(OpInfo)
                 if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING]
    assert defaulted == []


def _schema_history(op_type: str) -> list[onnx.defs.OpSchema]:
    return [s for s in onnx.defs.get_all_schemas_with_history()
            if s.name == op_type and s.domain == ""]


def _is_rule(value) -> bool:
    return isinstance(value, MappingType) or callable(value)


# What each field of a record must hold (a new field must be added here, and to every record).
FIELD_CHECKS = {
    "op_type": lambda v: isinstance(v, str),
    "mapping": _is_rule,
    "flops": callable,
    "pattern": lambda v: isinstance(v, ops.Pattern),
    "compute_intensive": lambda v: isinstance(v, bool),
    "row_locality": lambda v: isinstance(v, ops.RowLocality),
    "recurrent": lambda v: isinstance(v, bool),
    "foldable": lambda v: isinstance(v, bool),
    "static_value": lambda v: isinstance(v, bool),
    "value_flow": lambda v: isinstance(v, ops.ValueFlow),
    "gather_indices": lambda v: v is None or isinstance(v, int),
    "symmetric": lambda v: isinstance(v, bool),
    "properties": lambda v: isinstance(v, frozenset),
    "string_attrs": lambda v: isinstance(v, Mapping),
    "shape_rule": lambda v: isinstance(v, ops.ShapeRule),
    "attributes_now_inputs": lambda v: isinstance(v, tuple),
    "in_paper": lambda v: isinstance(v, bool),
    "opaque": lambda v: isinstance(v, bool),
}


def test_every_field_is_checked():
    assert [f.name for f in dataclasses.fields(OpInfo)] == list(FIELD_CHECKS)


@pytest.mark.parametrize("op_type", sorted(registered()))
def test_every_lowered_op_has_a_complete_record(op_type):
    info = op_info(op_type)
    for name, check in FIELD_CHECKS.items():
        assert check(getattr(info, name)), f"{op_type}.{name} = {getattr(info, name)!r}"
    assert info.op_type == op_type
    # every string attribute ONNX defines for the op (any opset) lists its allowed values
    # (test_every_op_lists_its_string_attributes checks the ops without a lowering)
    string_attrs = {name for s in _schema_history(op_type) for name, a in s.attributes.items()
                    if a.type in STRING_TYPES}
    assert set(info.string_attrs) == string_attrs, op_type
    for name, allowed in info.string_attrs.items():
        if allowed is not ANY_TEXT:
            assert allowed and all(isinstance(v, str) for v in allowed), (op_type, name)
            default = attr_default(op_type, name, None)
            defaults = default if isinstance(default, list) else [] if default is None else [default]
            assert set(defaults) <= allowed, (op_type, name, default)
    # the attributes older opsets took and the latest take as inputs exist in both
    for name, position, _, last_opset in info.attributes_now_inputs:
        assert name in onnx.defs.get_schema(op_type, last_opset, "").attributes
        assert position < len(onnx.defs.get_schema(op_type).inputs)


def test_every_op_lists_its_string_attributes():
    for name, info in known_ops().items():
        string_attrs = {n for s in _schema_history(name) for n, a in s.attributes.items()
                        if a.type in STRING_TYPES}
        assert set(info.string_attrs) == string_attrs, name


def test_records_agree_with_each_other():
    for name, info in known_ops().items():
        assert (info.pattern is ops.Pattern.OPAQUE) == info.opaque, name
        assert (info.pattern is ops.Pattern.ANCHOR) == (info.compute_intensive and not info.opaque), name
        if info.recurrent:
            assert info.compute_intensive and info.opaque, name
        if info.static_value:
            assert info.foldable, name
        if info.symmetric:
            assert ops.COMMUTATIVE in info.properties or name == "Equal" or name == "Mean", name


# --- attribute defaults from ONNX's schemas ----------------------------------------------------------

def test_attribute_defaults_follow_the_models_opset():
    assert attr_default("Softmax", "axis", 11) == 1  # the input seen as 2-D from axis 1
    assert attr_default("Softmax", "axis", 13) == -1
    assert attr_default("LogSoftmax", "axis", 12) == 1
    assert attr_default("BatchNormalization", "epsilon", 15) == 1e-5  # not float32's 9.99…e-06
    assert attr_default("Gelu", "approximate", 20) == "none"
    assert attr_default("Gather", "axis", 13) == 0
    assert attr_default("GatherND", "axis", 13) is None  # GatherND has no axis
    assert attr_default("Relu", "alpha", 14) is None


# --- no op-name lists outside the registry ------------------------------------------------------------

# Where lists of op names are the point: the registry, and the lowerings registered by op name.
REGISTRIES = ("kiln/ops/", "kiln/codegen/ops/")
# Constructors whose op-name arguments are a rewrite pattern's alternatives.
PATTERN_CONSTRUCTORS = frozenset({"one_of", "Node"})


def _op_names(node: ast.AST) -> list[str]:
    """ONNX op names a literal spells: strings, words of a string, and nested tuples/lists."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [w for w in node.value.split() if w in ONNX_OPS]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [n for e in node.elts for n in _op_names(e)]
    return []


def _collections(tree: ast.AST):
    """(node, op names) for every literal collection, dict's keys, membership test or
    "A B C".split() that names at least two ONNX ops."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Set, ast.Tuple, ast.List)):
            names = _op_names(node)
        elif isinstance(node, ast.Dict):
            names = [n for k in node.keys if k is not None for n in _op_names(k)]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "split"):
            names = _op_names(node.func.value)
        else:
            continue
        if len(names) >= 2:
            yield node, names


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}


def _functions(tree: ast.AST) -> set[str]:
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _is_pattern_use(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Is `node` (a literal, or a name bound to one) used as rewrite patterns use op names: the
    iterable of a for loop defining one rule per op, or a pattern node's alternatives?"""
    parent = parents.get(node)
    if isinstance(parent, ast.For) and parent.iter is node:
        return True
    if isinstance(parent, ast.Starred):
        node, parent = parent, parents.get(parent)
    if isinstance(parent, ast.Call) and node in parent.args:
        func = parent.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
        return name in PATTERN_CONSTRUCTORS
    return False


def _is_registration(node: ast.AST, functions: set[str]) -> bool:
    """A dict from op names to functions registers implementations, it decides no property."""
    return (isinstance(node, ast.Dict) and bool(node.values)
            and all(isinstance(v, ast.Name) and v.id in functions for v in node.values))


def op_name_lists(source: str) -> list[tuple[int, list[str]]]:
    """Line and names of every list of op names in `source` that decides a property."""
    tree = ast.parse(source)
    parents, functions = _parents(tree), _functions(tree)
    uses: dict[str, list[ast.Name]] = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
            uses.setdefault(n.id, []).append(n)
    found = []
    for node, names in _collections(tree):
        if _is_registration(node, functions) or _is_pattern_use(node, parents):
            continue
        bound = parents.get(node)
        if (isinstance(bound, ast.Assign) and len(bound.targets) == 1
                and isinstance(bound.targets[0], ast.Name)):
            readers = uses.get(bound.targets[0].id, [])
            if readers and all(_is_pattern_use(r, parents) for r in readers):
                continue
        found.append((node.lineno, names))
    return found


def test_the_checker_finds_op_name_lists_however_they_are_spelt():
    flagged = """
INJECTIVE = frozenset({"Reshape", "Transpose"})
RECURRENT = "LSTM GRU RNN".split()
TABLE = {"Relu": 1, "Add": 2}
PAIRS = (("Relu", 0), ("Tanh", 1))
def f(op):
    return op.op_type in ("MatMul", "Gemm")
def g(op):
    for name in INJECTIVE:
        pass
    return op.op_type in INJECTIVE
"""
    assert sorted(line for line, _ in op_name_lists(flagged)) == [2, 3, 4, 5, 7]


def test_the_checker_allows_rewrite_patterns_and_registrations():
    allowed = """
def _shape(x): ...
def _size(x): ...
FROM_SHAPE = {"Shape": _shape, "Size": _size}
MOVES = ("Reshape", "Flatten")
rule("chain", one_of(*MOVES)(one_of(*MOVES)(X)))
rule("bcast", Node(("Add", "Mul"), (X, Y)))
for name, domain in (("Log", "pos"), ("Exp", None)):
    rule(name, op(name)(X))
ONE = ("Relu",)
"""
    assert op_name_lists(allowed) == []


def test_no_list_of_op_names_outside_the_registry_decides_a_property():
    found = []
    for path in sorted((ROOT / "kiln").rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative.startswith(REGISTRIES):
            continue
        found += [f"{relative}:{line} {names}" for line, names in op_name_lists(path.read_text())]
    assert found == [], "ask the op's record (kiln/ops) instead:\n" + "\n".join(found)
