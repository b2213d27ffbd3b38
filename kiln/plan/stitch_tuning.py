"""FusionStitching's schedule tuning and performance library (§4.3–4.4), on Kiln's ProfileStore.

The performance library is the profile database: an entry is keyed by the kernel signature of the
fused ops (`kiln.signature`) and a schedule, here `{"stitch_blocks": B, "stitch_columns": C,
"threads": T, ...}` as the tuner records it (`kiln.tune.search`; C = 0 or absent: a Row
schedule). The paper measures a missing key at once (JIT: generate, compile, run, insert); in Kiln
a partitioner measures nothing itself, so a miss is answered by the store's cost model and is
measured by the tuner (`kiln compile --tune quick|full`), which measures the plan's shortlisted
schedules of every stitched block (`FusionPlan.schedule_candidates`) and records them; the next
plan of the same model reads them back as hits.

Cost of a fusion with B blocks of a sched_type: a measured entry with that B, those columns and
this thread count, or the cost model's latency of the fused kernel × the load imbalance of B equal
chunks dealt statically to T threads, ceil(B/T)·T/B (B = 1 runs on one thread: ×T) × the access
factor of its realisation. B = 0 stands for the kernel without stitching (each stage's own
dynamic chunks: no imbalance, no affinity). The access factor is where Row and Column differ on
a CPU: a reduction over outer dims (a column reduction) run by rows walks each column with a
stride of a whole row: scalar loads, one cache line per element, no vector lanes. Its share of
the fusion's bytes costs `STRIDED_READ` times as much under a Row or unstitched realisation; a
Column realisation reads it along contiguous columns, but a chunk narrower than `VECTOR_LANES`
columns fills only part of a vector. As in the paper the cost is a figure to rank schedules by,
not a prediction of the exact time; measurements replace it.

Tuning (`tune`): every satisfiable Row and Column partition (`stitch_schedule.satisfiable`) is
costed by the model; the best `shortlist` of them (and B = 0) are re-ranked by measurement when
all of them have been measured, so that a measured figure is never compared with a modelled one.
On the model alone the unstitched kernel comes after every stitched schedule whose access factor
is no worse than its own (the affinity a stitched schedule buys is not in the model, its load
imbalance is), and before the others (Column chunks too narrow to fill a vector).
Fusion alternatives (`faster_fused`: a fusion with one more op against the fusion and the op
apart) are ranked by these costs at each one's best Row schedule, like with like in the same way.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

from kiln.ecg import Graph
from kiln.plan.stitch_schedule import (
    Resolved,
    column_extent,
    fusion_outputs,
    reduced_dims,
    reduces,
)
from kiln.profile import COST_MODEL, MEASURED, Estimate, ProfileStore

STITCH_KEY = "stitch_blocks"  # the kiln.codegen.schedule.Schedule field a stitched block sets
COLUMNS_KEY = "stitch_columns"  # and the one that makes its blocks Column chunks
UNSTITCHED = 0
# An entry of the library: the stitched schedule alone (the tuner adds the code's hash and the
# thread count); entries that also change other Schedule fields measure something else.
LIBRARY_KEYS = frozenset({STITCH_KEY, COLUMNS_KEY, "threads", "kernel"})
STRIDED_READ = 4.0  # a column reduction run by rows: a cache line and no lanes per element
VECTOR_LANES = 8  # float32 lanes of a 256-bit vector: the narrowest chunk that fills one

Candidate = tuple[int, int]  # (blocks, columns): columns 0 for Row or unstitched


def imbalance(blocks: int, threads: int) -> float:
    """Time of B equal chunks dealt statically to T threads, relative to a perfect split."""
    if blocks == UNSTITCHED:
        return 1.0
    return math.ceil(blocks / threads) * threads / blocks


@dataclass(frozen=True)
class Costed:
    blocks: int  # 0: unstitched
    estimate: Estimate
    columns: int = 0  # > 0: a Column schedule of the blocks over that many columns

    @property
    def key(self) -> Candidate:
        return (self.blocks, self.columns)

    @property
    def sched_type(self) -> str:
        return "column" if self.columns else "row" if self.blocks else "none"

    def overrides(self, explicit: bool = False) -> dict[str, Any]:
        """The Schedule fields of this candidate; `explicit` states a Row one's 0 columns too
        (the tuner lays a candidate over the plan's choice, which may be a Column one)."""
        if self.columns or explicit:
            return {STITCH_KEY: self.blocks, COLUMNS_KEY: self.columns}
        return {STITCH_KEY: self.blocks}


class PerformanceLibrary:
    """Costs of fused kernels under stitched schedules, from the store (cached per fusion)."""

    def __init__(self, graph: Graph, store: ProfileStore, threads: int, shortlist: int):
        self.graph, self.store, self.threads, self.shortlist = graph, store, threads, shortlist
        self.model = store.fallback or store
        self._modelled: dict[frozenset[str], Estimate] = {}
        self._measured: dict[frozenset[str], dict[Candidate, float]] = {}
        self.lookups = 0

    def modelled(self, members: Iterable[str]) -> Estimate:
        key = frozenset(members)
        if key not in self._modelled:
            self.lookups += 1
            ordered = sorted(key, key=self.graph.order.__getitem__)
            self._modelled[key] = self.model.latency(self.graph, ordered)
        return self._modelled[key]

    def measured(self, members: Iterable[str]) -> dict[Candidate, float]:
        """(blocks, columns) -> median seconds of the library's entries for this kernel and
        thread count."""
        key = frozenset(members)
        if key not in self._measured:
            found: dict[Candidate, float] = {}
            ordered = sorted(key, key=self.graph.order.__getitem__)
            for schedule, median in self.store.schedules(self.graph, ordered):  # best first
                if (isinstance(schedule, dict) and schedule.get("threads") == self.threads
                        and isinstance(schedule.get(STITCH_KEY), int)
                        and isinstance(schedule.get(COLUMNS_KEY, 0), int)
                        and set(schedule) <= LIBRARY_KEYS):
                    blocks = schedule[STITCH_KEY]
                    columns = schedule.get(COLUMNS_KEY, 0) if blocks != UNSTITCHED else 0
                    found.setdefault((blocks, columns), median)
            self._measured[key] = found
        return self._measured[key]

    def strided_share(self, members: Iterable[str]) -> float:
        """The share of the fusion's bytes read by reductions over outer dims (see the module)."""
        ops = [self.graph.op_by_id[i] for i in members]
        total = sum(op.bytes for op in ops)
        strided = sum(self.graph.tensors[op.inputs[0]].nbytes for op in ops
                      if _reduces_columns(self.graph, op))
        return min(1.0, strided / total) if total else 0.0

    def access(self, members: Iterable[str], blocks: int, columns: int) -> float:
        """The access factor of a realisation: Row or unstitched pays the strided reads, Column
        its chunks' unfilled vector lanes."""
        if columns:
            width = columns / blocks
            return max(1.0, VECTOR_LANES / width) if width < VECTOR_LANES else 1.0
        return 1.0 + (STRIDED_READ - 1.0) * self.strided_share(members)

    def tune(self, members: Iterable[str], resolved: Iterable[Resolved]) -> list[Costed]:
        """The shortlist of schedules for the fusion, best first (see the module docstring)."""
        members = frozenset(members)
        base = self.modelled(members).seconds
        root = self.graph.tensors[fusion_outputs(self.graph, set(members))[0]].shape
        modelled: dict[Candidate, Costed] = {}
        for r in resolved:
            if r.blocks <= 1:
                continue
            columns = column_extent(root, r.key)
            factor = imbalance(r.blocks, self.threads) * self.access(members, r.blocks, columns)
            modelled[(r.blocks, columns)] = Costed(r.blocks, Estimate(base * factor, COST_MODEL),
                                                   columns)
        # Ties go to the fewest blocks: one chunk per thread keeps each thread's data together.
        ranked = sorted(modelled.values(),
                        key=lambda c: (c.estimate.seconds, c.blocks, c.columns))[:self.shortlist]
        unstitched = self.access(members, UNSTITCHED, 0)
        ahead = [c for c in ranked if self.access(members, c.blocks, c.columns) <= unstitched]
        ranked = [*ahead, Costed(UNSTITCHED, Estimate(base * unstitched, COST_MODEL)),
                  *(c for c in ranked if c not in ahead)]
        measured = self.measured(members)
        if all(c.key in measured for c in ranked):
            ranked = sorted((Costed(c.blocks, Estimate(measured[c.key], MEASURED), c.columns)
                             for c in ranked),
                            key=lambda c: (c.estimate.seconds, c.blocks, c.columns))
        return ranked

    def predicted(self, members: Iterable[str], resolved: Iterable[Resolved],
                  model_only: bool = False) -> Estimate:
        """The fusion's latency at its best Row schedule: the best measured one of its
        satisfiable schedules if the library has any, else the cost model's."""
        members = frozenset(members)
        blocks = {r.blocks for r in resolved} or {1}
        measured = {} if model_only else self.measured(members)
        hits = [measured[(b, 0)] for b in blocks | {UNSTITCHED} if (b, 0) in measured]
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


def _reduces_columns(graph: Graph, op) -> bool:
    """A reduction whose reduced dims lie left of kept dims with more than one element: run by
    rows, each of its rows is a strided walk down a column."""
    if not reduces(op) or not op.inputs:
        return False
    reduced = reduced_dims(graph, op)
    shape = graph.tensors[op.inputs[0]].shape
    return bool(reduced) and math.prod(shape[max(reduced) + 1:]) > 1
