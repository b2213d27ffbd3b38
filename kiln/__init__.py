"""Kiln: an operator-fusion compiler for deep-learning inference."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kiln.runtime.loader import CompiledModel

__version__ = "0.1.0"


def load(path: str, threads: int | None = None) -> "CompiledModel":
    """Load a compiled artifact (`model.kiln`) as a callable on numpy arrays; see kiln.runtime.loader."""
    from kiln.runtime.loader import load as load_artifact

    return load_artifact(path, threads)
