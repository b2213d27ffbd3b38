"""Schedule tuning: per distinct block, search the schedule parameters (`kiln.codegen.schedule`)
by measuring candidate kernels on this CPU, with every measurement kept in the ProfileStore.

    result = tune_plan(plan, target, store, mode="quick", budget_s=60)
    kernels = generate(plan, target, block_schedules=result.block_schedules)

`space` defines the per-block search space, `search` holds the tuner (`quick`: fixed
candidates; `full`: a genetic search), `report` prints its report. kiln.measure.harness compiles
and times the candidates.
"""
from __future__ import annotations

from kiln.tune.search import (
    DEFAULT_BUDGET_S,
    DEFAULT_MODE,
    TUNE_MODES,
    TuneError,
    TuneResult,
    check_budget,
    check_mode,
    tune_plan,
)
from kiln.tune.report import format_seconds, format_tuning

__all__ = ["DEFAULT_BUDGET_S", "DEFAULT_MODE", "TUNE_MODES", "TuneError", "TuneResult", "check_budget",
           "check_mode", "format_seconds", "format_tuning", "tune_plan"]
