"""Measuring candidate kernels on a device elsewhere: how the tuner reaches targets this machine
cannot run (another CPU architecture, a GPU it lacks).

A `Farm` is handed to `kiln.tune.tune_plan` by whoever knows of devices: the compilation service
supplies one that sends each batch as a probe artifact through the same measurement task queue as
the planner's yellow-case lookups, to a device of the target's kind, within the tuning deadline. The device's results land in the profile database under its fingerprint (the
farm records them, not the tuner): candidates are filed as their schedule overrides plus the
tuner's keys, `kernel` (the hash of the candidate's code) and `threads`.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kiln.ecg import Graph
from kiln.measure.harness import BatchResult


@dataclass(frozen=True)
class FarmCandidate:
    key: str  # the tuner's kernel hash: the entry's "kernel"
    overrides: Mapping[str, Any]  # the schedule the kernel is generated with


class Farm(Protocol):
    device: str  # the device class it measures on, for the tuning report
    threads: int | None  # the thread count candidates run with there (their "threads" key)

    def schedules(self, graph: Graph, op_ids: Sequence[str]) -> list[tuple[dict[str, Any], float]]:
        """Every schedule recorded for this kernel on the farm's device class, best first."""
        ...

    def measure(self, graph: Graph, op_ids: Sequence[str], candidates: Sequence[FarmCandidate],
                deadline: float) -> BatchResult:
        """Seconds per call of each candidate, by key (or why it failed), measured on the
        device and recorded there; what is not back by `deadline` (time.monotonic()) is left
        out."""
        ...
