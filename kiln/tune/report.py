"""The tuning report as text (`kiln compile --tune`, `kiln submit --wait`)."""
from __future__ import annotations

import json
from typing import Any


def format_seconds(seconds: float) -> str:
    """`0.42 µs`, `12.3 ms`: a unit that keeps three significant digits visible."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def format_tuning(t: dict[str, Any]) -> str:
    """A summary line, then per tuned group its default and best time (or why it has none) and
    the reasons its failed measurements gave."""
    if "all" in t.get("skipped", {}):
        return f"tuning ({t['mode']}): skipped: {t['skipped']['all']}"
    where = f" on {t['device']}" if t.get("device", "this machine") != "this machine" else ""
    threads = f"{t['threads']} threads" if t.get("threads") else "the device's threads"
    lines = [f"tuning ({t['mode']}, {threads}{where}): {len(t['groups'])} distinct blocks, "
             f"{t['measured']} kernels measured, {t['reused']} reused from the profile database, "
             f"{t['failed']} failed; {t['seconds']:.1f} s of {t['budget_s']:g} s; "
             f"{len(t['schedules'])} blocks with a non-default schedule"]
    for g in t["groups"]:
        name = f"  {g['name'][:48]:48s} x{g['blocks']:<3d}"
        if g.get("best_ms") and g.get("default_ms"):
            lines.append(f"{name} {format_seconds(g['default_ms'] / 1e3):>9s} -> "
                         f"{format_seconds(g['best_ms'] / 1e3):>9s}  {json.dumps(g['best'])}")
        elif g.get("note"):
            lines.append(f"{name} not tuned: {g['note']}")
        for failure in g.get("failures", []):
            lines.append(f"      failed {json.dumps(failure['schedule'])}: {failure['reason']}")
    return "\n".join(lines)
