"""Schedule tuning: per distinct block, search the schedule parameters (`kiln.codegen.schedule`)
by measuring candidate kernels on this CPU, with every measurement kept in the ProfileStore.

    result = tune_plan(plan, target, store, mode="quick", budget_s=60)
    kernels = generate(plan, target, block_schedules=result.block_schedules)

`modes` names the tuning modes and checks budgets, `space` defines the per-block search space,
`search` holds the tuner (`quick`: fixed candidates; `full`: a genetic search), `report` prints
its report. kiln.measure.harness compiles and times the candidates.
"""
from __future__ import annotations

import importlib

from kiln.tune.modes import (
    DEFAULT_BUDGET_S,
    DEFAULT_MODE,
    TUNE_MODES,
    TuneError,
    check_budget,
    check_mode,
)
from kiln.tune.report import format_seconds, format_tuning

# The tuner loads the code generator: it is imported when first used, so that a command line that
# only names a mode or a budget (every `kiln` command builds the compile and submit parsers)
# starts without it.
_LAZY = {"TuneResult": "kiln.tune.search", "tune_plan": "kiln.tune.search",
         "tune_by_parts": "kiln.tune.reformer"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name == "TUNERS":
        return _tuners()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _tuners() -> dict:
    """How a partitioner's plans are tuned (its `tuning` attribute; per block when it has none):
    AGO's plans of complicated subgraphs by its reformer layer's divide and conquer."""
    from kiln.tune.reformer import tune_by_parts
    from kiln.tune.search import tune_plan

    return {"per-block": tune_plan, "divide-and-conquer": tune_by_parts}


def tuner_for(partitioner: object):
    """The tuning function (`tune_plan`'s signature) for a partitioner's plans."""
    return _tuners()[getattr(partitioner, "tuning", "per-block")]


__all__ = ["DEFAULT_BUDGET_S", "DEFAULT_MODE", "TUNERS", "TUNE_MODES", "TuneError", "TuneResult", "check_budget",
           "check_mode", "format_seconds", "format_tuning", "tune_by_parts", "tune_plan",
           "tuner_for"]
