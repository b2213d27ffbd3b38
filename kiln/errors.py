"""Errors Kiln reports to its users. Each message names what was wrong."""
from __future__ import annotations


class KilnError(Exception):
    """Base of every error Kiln raises on purpose."""


class ModelError(KilnError):
    """The model file is unreadable, invalid, or refers to data it may not use."""


class UnsupportedOpsError(ModelError):
    """The model uses operators Kiln cannot compile; every one is listed."""

    def __init__(self, unsupported: dict[str, list[str]]):
        self.unsupported = unsupported
        parts = [f"{op} (nodes: {', '.join(names[:3])}{', …' if len(names) > 3 else ''})"
                 for op, names in sorted(unsupported.items())]
        super().__init__(f"unsupported operators ({len(unsupported)}): " + "; ".join(parts))


class ShapeError(ModelError):
    """A shape is symbolic, unknown, or out of bounds."""


class PlanError(KilnError):
    """A fusion plan is invalid (for example cyclic)."""
