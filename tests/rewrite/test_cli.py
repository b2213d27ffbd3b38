"""`kiln rules`, `kiln compile --no-rewrite`, and the rewrite keys of the fusion report."""
from __future__ import annotations

import json
import re
from pathlib import Path

from kiln.cli import main
from kiln.pipeline import CompileOptions, compile_model
from kiln.profile.local import default_store
from kiln.rewrite import CATEGORIES, all_rules, rules_by_category
from kiln.rewrite.dsl import Node

ZOO = Path(__file__).resolve().parents[1] / "fixtures" / "zoo"


def test_kiln_rules_lists_every_rule_by_category(capsys):
    assert main(["rules"]) == 0
    out = capsys.readouterr().out
    groups = rules_by_category()
    for category in CATEGORIES:
        assert f"{category} ({len(groups[category])} rules)" in out
    total = re.search(r"total: (\d+) rules", out)
    assert total and int(total.group(1)) == len(all_rules()) >= 100
    for r in all_rules():
        assert re.search(rf"^  {r.name}\s", out, re.MULTILINE), r.name


def test_kiln_rules_filters_and_writes_json(capsys):
    assert main(["rules", "--category", "commutative", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert list(listed) == ["commutative"]
    assert {r["name"] for r in listed["commutative"]} == \
        {r.name for r in rules_by_category()["commutative"]}


def test_rules_are_distinct_and_table4_is_covered():
    rules = all_rules()
    assert len({r.name for r in rules}) == len(rules)
    patterns = [(r.describe(), r.category) for r in rules]
    assert len(set(patterns)) == len(patterns)  # no rule registered twice under another name
    table4 = {r.name for r in rules if r.source == "Table 4"}
    assert {"recip_mul_recip", "sqrt_mul_sqrt", "abs_mul_abs", "reducesum_mul_square",
            "factor_mul_add", "add_mul_self", "square_sub_factor", "reducesum_bitshift",
            "reduceprod_exp"} <= table4
    for category in CATEGORIES:
        assert rules_by_category()[category], category
    assert all(isinstance(r.pattern, Node) for r in rules)


def test_report_has_the_rewrite_keys():
    store = default_store(":memory:")
    on = compile_model(ZOO / "gpt2.onnx", CompileOptions(), store).report
    off = compile_model(ZOO / "gpt2.onnx", CompileOptions(rewrite=False), store).report
    assert on["rules_fired"] and all(n > 0 for n in on["rules_fired"].values())
    assert on["flops_after"] < on["flops_before"] == off["flops_before"] == off["flops_after"]
    assert off["rules_fired"] == {}
    assert "rewrite" in on["seconds"] and "rewrite" not in off["seconds"]
    assert on["ops_before"] == off["ops_before"]  # the frontend's graph, before rewriting
    assert on["kernels"] < off["kernels"]


def test_compile_no_rewrite_flag(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert main(["compile", str(ZOO / "tinybert.onnx"), "--no-rewrite", "--profile-db",
                 ":memory:", "--report-json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["rules_fired"] == {} and report["flops_before"] == report["flops_after"]
    assert "rewrite rules fired" in capsys.readouterr().out
