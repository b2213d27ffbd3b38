"""Math-property graph rewriting (DNNFusion §4.2, Figure 2, Table 4): the stage between the
frontend and the planner.

`rewrite(graph)` applies the registered rules greedily (see `kiln.rewrite.engine`) and returns a
`RewriteResult`: the rewritten ECG, how often each rule fired, and the FLOPs before and after.
Rules are data (`kiln.rewrite.dsl`), defined by category in `associative`, `distributive`,
`commutative` and `simplify`; `kiln rules` lists them.
"""
from __future__ import annotations

from kiln.rewrite.dsl import CATEGORIES, SIMPLIFY, Rule
from kiln.rewrite.engine import RewriteResult, apply_once, rewrite

RULE_MODULES = ("associative", "distributive", "commutative", "simplify")


def all_rules() -> list[Rule]:
    """Every registered rule, in registration order (the engine's tie-break)."""
    import importlib

    from kiln.rewrite.dsl import registered

    for module in RULE_MODULES:
        importlib.import_module(f"kiln.rewrite.{module}")
    return registered()


def rules_by_category() -> dict[str, list[Rule]]:
    found: dict[str, list[Rule]] = {category: [] for category in CATEGORIES}
    for r in all_rules():
        found[r.category].append(r)
    return found


__all__ = ["CATEGORIES", "SIMPLIFY", "Rule", "RewriteResult", "all_rules", "apply_once",
           "rewrite", "rules_by_category"]
