"""FusionStitching's schedule tuning and performance library (§4.3–4.4), on Kiln's ProfileStore.

The performance library is the profile database: an entry is keyed by the kernel signature of the
fused ops (`kiln.signature`) and a schedule, here `{"stitch_blocks": B, "threads": T, ...}` as the
tuner records it (`kiln.tune.search`). The paper measures a missing key at once (JIT: generate,
compile, run, insert); in Kiln a partitioner measures nothing itself, so a miss is answered by the
store's cost model and is measured by the tuner (`kiln compile --tune quick|full`), which measures
the plan's shortlisted schedules of every stitched block (`FusionPlan.schedule_candidates`) and
records them; the next plan of the same model reads them back as hits.

Cost of a fusion with B blocks: a measured entry with that B and this thread count, or
the cost model's latency of the fused kernel × the load imbalance of B equal chunks dealt
statically to T threads, ceil(B/T)·T/B (B = 1 runs on one thread: ×T). B = 0 stands for the
kernel without stitching (each stage's own dynamic chunks: no imbalance, no affinity). As in the
paper the cost is a figure to rank schedules by, not a prediction of the exact time.

Tuning (`tune`): every satisfiable Row partition (`stitch_schedule.satisfiable`) is costed by the
model; the best `shortlist` of them (and B = 0) are re-ranked by measurement when all of them
have been measured, so that a measured figure is never compared with a modelled one. Fusion
alternatives (`faster_fused`: a fusion with one more op against the fusion and the op apart) are
ranked by these costs at each one's best schedule, like with like in the same way.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from kiln.ecg import Graph
from kiln.plan.stitch_schedule import Resolved
from kiln.profile import COST_MODEL, MEASURED, Estimate, ProfileStore

STITCH_KEY = "stitch_blocks"  # the kiln.codegen.schedule.Schedule field a stitched block sets
UNSTITCHED = 0
# An entry of the library: the stitched schedule alone (the tuner adds the code's hash and the
# thread count); entries that also change other Schedule fields measure something else.
LIBRARY_KEYS = frozenset({STITCH_KEY, "threads", "kernel"})


def imbalance(blocks: int, threads: int) -> float:
    """Time of B equal chunks dealt statically to T threads, relative to a perfect split."""
    if blocks == UNSTITCHED:
        return 1.0
    return math.ceil(blocks / threads) * threads / blocks


@dataclass(frozen=True)
class Costed:
    blocks: int  # 0: unstitched
    estimate: Estimate


class PerformanceLibrary:
    """Costs of fused kernels under stitched schedules, from the store (cached per fusion)."""

    def __init__(self, graph: Graph, store: ProfileStore, threads: int, shortlist: int):
        self.graph, self.store, self.threads, self.shortlist = graph, store, threads, shortlist
        self.model = store.fallback or store
        self._modelled: dict[frozenset[str], Estimate] = {}
        self._measured: dict[frozenset[str], dict[int, float]] = {}
        self.lookups = 0

    def modelled(self, members: Iterable[str]) -> Estimate:
        key = frozenset(members)
        if key not in self._modelled:
            self.lookups += 1
            ordered = sorted(key, key=self.graph.order.__getitem__)
            self._modelled[key] = self.model.latency(self.graph, ordered)
        return self._modelled[key]

    def measured(self, members: Iterable[str]) -> dict[int, float]:
        """Blocks -> median seconds of the library's entries for this kernel and thread count."""
        key = frozenset(members)
        if key not in self._measured:
            found: dict[int, float] = {}
            ordered = sorted(key, key=self.graph.order.__getitem__)
            for schedule, median in self.store.schedules(self.graph, ordered):  # best first
                if (isinstance(schedule, dict) and schedule.get("threads") == self.threads
                        and isinstance(schedule.get(STITCH_KEY), int)
                        and set(schedule) <= LIBRARY_KEYS):
                    found.setdefault(schedule[STITCH_KEY], median)
            self._measured[key] = found
        return self._measured[key]

    def tune(self, members: Iterable[str], resolved: Iterable[Resolved]) -> list[Costed]:
        """The shortlist of schedules for the fusion, best first (see the module docstring)."""
        members = frozenset(members)
        base = self.modelled(members).seconds
        blocks = sorted({r.blocks for r in resolved if r.blocks > 1})
        modelled = [Costed(b, Estimate(base * imbalance(b, self.threads), COST_MODEL))
                    for b in blocks]
        # Ties go to the fewest blocks: one chunk per thread keeps each thread's rows together.
        ranked = sorted(modelled, key=lambda c: (c.estimate.seconds, c.blocks))[:self.shortlist]
        ranked.append(Costed(UNSTITCHED, Estimate(base, COST_MODEL)))
        measured = self.measured(members)
        if all(c.blocks in measured for c in ranked):
            ranked = sorted((Costed(c.blocks, Estimate(measured[c.blocks], MEASURED))
                             for c in ranked), key=lambda c: (c.estimate.seconds, c.blocks))
        return ranked

    def predicted(self, members: Iterable[str], resolved: Iterable[Resolved],
                  model_only: bool = False) -> Estimate:
        """The fusion's latency at its best schedule: the best measured one of its satisfiable
        schedules if the library has any, else the cost model's."""
        members = frozenset(members)
        blocks = {r.blocks for r in resolved} or {1}
        measured = {} if model_only else self.measured(members)
        hits = [measured[b] for b in blocks | {UNSTITCHED} if b in measured]
        if hits:
            return Estimate(min(hits), MEASURED)
        factor = min(imbalance(b, self.threads) for b in blocks | {UNSTITCHED})
        return Estimate(self.modelled(members).seconds * factor, COST_MODEL)

    def faster_fused(self, together: tuple[Iterable[str], list[Resolved]],
                     apart: list[tuple[Iterable[str], list[Resolved]]]) -> bool:
        """Does one kernel beat the parts run one after another? Like with like: when the answers
        do not all come from the library's measurements, all come from the cost model."""
        parts = [self.predicted(m, r) for m, r in [together, *apart]]
        if len({e.source for e in parts}) > 1:
            parts = [self.predicted(m, r, model_only=True) for m, r in [together, *apart]]
        return parts[0].seconds <= sum(e.seconds for e in parts[1:])
