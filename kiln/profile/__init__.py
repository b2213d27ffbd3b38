"""Profiling: the ProfileStore interface the planner and tuner ask for block latencies.

Stages never measure on their own; they ask the store they were handed. Every answer says where it
came from, so a report can tell measured latencies from predictions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from kiln.ecg import Graph

MEASURED, PREDICTED, COST_MODEL = "measured", "predicted", "cost-model"


@dataclass(frozen=True)
class Estimate:
    seconds: float
    source: str  # MEASURED, PREDICTED or COST_MODEL


class ProfileStore(Protocol):
    def latency(self, graph: Graph, op_ids: Sequence[str]) -> Estimate:
        """Latency of the ops `op_ids` of `graph` run as one fused kernel."""
        ...

    def record(self, graph: Graph, op_ids: Sequence[str], seconds: Sequence[float],
               source: str = MEASURED) -> None:
        """Remember latency samples for the fused kernel of `op_ids`."""
        ...
