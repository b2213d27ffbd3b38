"""Profiling: the ProfileStore interface the planner and tuner ask for block latencies.

Stages never measure on their own; they ask the store they were handed. Every answer says where it
came from, so a report can tell measured latencies from predictions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence, runtime_checkable

from kiln.ecg import Graph

MEASURED, PREDICTED, COST_MODEL = "measured", "predicted", "cost-model"


@dataclass(frozen=True)
class Estimate:
    seconds: float  # the median of measured samples
    source: str  # MEASURED, PREDICTED or COST_MODEL
    # The 10th and 90th percentiles of the samples behind a measured answer (None for a model's
    # answer): two measured latencies whose ranges overlap are not known to differ.
    p10: float | None = None
    p90: float | None = None

    @property
    def low(self) -> float:
        return self.seconds if self.p10 is None else self.p10

    @property
    def high(self) -> float:
        return self.seconds if self.p90 is None else self.p90


Schedule = dict[str, Any]  # overrides of kiln.codegen.schedule.Schedule, plus the tuner's keys


@runtime_checkable
class ProfileStore(Protocol):
    """What the planner and the tuner may ask. A cost model is a store too: it answers
    `latency`, its `fallback` is None and its `schedules` empty, and it refuses `record`."""

    # The cost model this store answers from when it has no measurement (None for a cost model
    # itself). The planner compares like with like through it; the tuner weighs blocks with it.
    fallback: "ProfileStore | None"

    def latency(self, graph: Graph, op_ids: Sequence[str]) -> Estimate:
        """Latency of the ops `op_ids` of `graph` run as one fused kernel."""
        ...

    def record(self, graph: Graph, op_ids: Sequence[str], seconds: float | Sequence[float],
               source: str = MEASURED, schedule: Schedule | None = None,
               toolchain: str = "") -> None:
        """Remember latency samples for the fused kernel of `op_ids` run with `schedule`.
        A store that keeps no measurements raises NotImplementedError."""
        ...

    def schedules(self, graph: Graph, op_ids: Sequence[str]) -> list[tuple[Schedule, float]]:
        """Every schedule recorded for this kernel on the store's machine with its median
        seconds, best first (empty for a store that keeps no measurements)."""
        ...


def check_store(store: object) -> ProfileStore:
    """`store` itself, or a TypeError naming the members of the protocol it lacks."""
    if not isinstance(store, ProfileStore):
        members = ["fallback"] + [n for n, v in vars(ProfileStore).items()
                                  if callable(v) and not n.startswith("_")]
        missing = [n for n in members if not hasattr(store, n)]
        raise TypeError(f"{type(store).__name__} is not a kiln.profile.ProfileStore: it lacks "
                        f"{', '.join(missing)}")
    return store
