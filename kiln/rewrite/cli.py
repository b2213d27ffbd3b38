"""`kiln rules`: the graph-rewriting rules, by category."""
from __future__ import annotations

import argparse
import json

from kiln.rewrite import CATEGORIES, rules_by_category


def _rules(args: argparse.Namespace) -> int:
    groups = rules_by_category()
    shown = [args.category] if args.category else list(CATEGORIES)
    if args.json:
        print(json.dumps({c: [{"name": r.name, "source": r.source, "rule": r.describe(),
                               "enabling": r.enabling, "note": r.note} for r in groups[c]]
                          for c in shown}, indent=2))
        return 0
    width = max(len(r.name) for c in shown for r in groups[c])
    for category in shown:
        print(f"{category} ({len(groups[category])} rules)")
        for r in groups[category]:
            tag = " [enabling]" if r.enabling else ""
            print(f"  {r.name.ljust(width)}  {r.describe()}{tag}")
            if args.verbose and (r.note or r.source != "implied"):
                print(f"  {''.ljust(width)}    {r.source}{': ' + r.note if r.note else ''}")
        print()
    counts = ", ".join(f"{c} {len(groups[c])}" for c in shown)
    print(f"total: {sum(len(groups[c]) for c in shown)} rules ({counts})")
    return 0


def add_commands(commands) -> None:
    cmd = commands.add_parser("rules", help="list the graph-rewriting rules by category")
    cmd.add_argument("--category", choices=CATEGORIES, help="only this category")
    cmd.add_argument("-v", "--verbose", action="store_true", help="with sources and notes")
    cmd.add_argument("--json", action="store_true", help="as JSON")
    cmd.set_defaults(handler=_rules)
