"""The tuning modes and budgets that commands and requests name, and their checks: what a command
line or a job's options need, without the tuner itself (which loads the code generator)."""
from __future__ import annotations

from kiln.errors import KilnError

TUNE_MODES = ("off", "reuse", "quick", "full")
DEFAULT_MODE = "reuse"
DEFAULT_BUDGET_S = {"quick": 60.0, "full": 600.0}


class TuneError(KilnError):
    pass


def check_mode(mode: str) -> str:
    if mode not in TUNE_MODES:
        raise TuneError(f"unknown tuning mode {mode!r}; choose one of {', '.join(TUNE_MODES)}")
    return mode


def check_budget(budget: float | None) -> float | None:
    if budget is None:
        return None
    try:
        value = float(budget)
    except (TypeError, ValueError):
        raise TuneError(f"the tuning budget must be a number of seconds, not {budget!r}") from None
    if not value > 0 or value == float("inf"):
        raise TuneError(f"the tuning budget must be a positive number of seconds, not {budget!r}")
    return value
