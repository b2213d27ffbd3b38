"""Where the tuner's candidates run: on this CPU (kiln.measure.harness), or on a device of the farm
(kiln.measure.farm). Both answer the same three questions: what is known already, measure this
batch, and whether the tuner files the times itself."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kiln.codegen import Kernel
from kiln.ecg import Graph
from kiln.measure.farm import Farm, FarmCandidate
from kiln.measure.harness import BatchResult, Candidate, Harness
from kiln.profile import ProfileStore
from kiln.runtime.toolchain import BuildCache, compiler_for
from kiln.target import Target

# One candidate of a batch: (kernel hash, schedule overrides, kernel)
Item = tuple[str, dict[str, Any], Kernel]


class LocalMeasurer:
    """Candidates compiled and timed here; the tuner records their times in its store."""

    records = True
    measures = True

    def __init__(self, graph: Graph, target: Target, store: ProfileStore, threads: int):
        self.graph, self.store, self.threads = graph, store, threads
        self.where = "this machine"
        self.harness = Harness(graph, compiler_for(target), BuildCache(), threads)

    def stored(self, op_ids: Sequence[str]) -> list[tuple[dict[str, Any], float]]:
        return self.store.schedules(self.graph, op_ids)

    def measure(self, op_ids: Sequence[str], batch: Sequence[Item], deadline: float) -> BatchResult:
        return self.harness.measure([Candidate(h, k) for h, _, k in batch], deadline)

    def close(self) -> None:
        self.harness.close()


class FarmMeasurer:
    """Candidates measured on a farm device, which records them under its own fingerprint."""

    records = False
    measures = True

    def __init__(self, graph: Graph, farm: Farm):
        self.graph, self.farm = graph, farm
        self.threads = farm.threads
        self.where = farm.device

    def stored(self, op_ids: Sequence[str]) -> list[tuple[dict[str, Any], float]]:
        return self.farm.schedules(self.graph, op_ids)

    def measure(self, op_ids: Sequence[str], batch: Sequence[Item], deadline: float) -> BatchResult:
        return self.farm.measure(self.graph, op_ids,
                                 [FarmCandidate(h, overrides) for h, overrides, _ in batch],
                                 deadline)

    def close(self) -> None:
        pass


class StoredMeasurer:
    """Measures nothing: the tuner's `reuse` mode sees only what the store holds already."""

    records = False
    measures = False

    def __init__(self, graph: Graph, store: ProfileStore, threads: int):
        self.graph, self.store, self.threads = graph, store, threads
        self.where = "the profile database"

    def stored(self, op_ids: Sequence[str]) -> list[tuple[dict[str, Any], float]]:
        return self.store.schedules(self.graph, op_ids)

    def measure(self, op_ids: Sequence[str], batch: Sequence[Item], deadline: float) -> BatchResult:
        return BatchResult()

    def close(self) -> None:
        pass
