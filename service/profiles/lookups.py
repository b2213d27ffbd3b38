"""What a compile asked the profiling database, and the plan it made: kept per job.

`LookupRecorder` wraps the compile's ProfileStore and notes every `latency` question (the ops, their
kernel signature, the estimate's source and — from stores that count their answers, like
workers.profile_store — the kind of answer: hit, measured-local, cost-model (why), …).
`save_compile` stores those lookups and the report's plan graph for the job (again and again
harmlessly: a rerun replaces them).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

from sqlalchemy import delete

from service.db import Database
from service.profiles.tables import JobLookup, JobPlan

MAX_LOOKUPS_KEPT = 100_000  # per job; a compile that asks more keeps the first ones


@dataclass(frozen=True)
class Lookup:
    ops: tuple[str, ...]
    signature: str
    answer: str
    source: str
    seconds: float


class LookupRecorder:
    """A ProfileStore that passes every call to `inner` and remembers the `latency` answers."""

    def __init__(self, inner):
        self.inner = inner
        self.lookups: list[Lookup] = []

    def __getattr__(self, name: str):  # schedules, record, fallback, stats… are the inner store's
        return getattr(self.inner, name)

    def latency(self, graph, op_ids: Sequence[str]):
        from kiln.signature import kernel_signature

        before = self._counts()
        estimate = self.inner.latency(graph, op_ids)
        if len(self.lookups) < MAX_LOOKUPS_KEPT:
            changed = self._counts() - before
            answer = next(iter(changed), estimate.source) if changed else estimate.source
            self.lookups.append(Lookup(tuple(op_ids), kernel_signature(graph, op_ids), answer,
                                       estimate.source, float(estimate.seconds)))
        return estimate

    def _counts(self) -> Counter[str]:
        stats = getattr(self.inner, "stats", None)
        return Counter(stats()) if callable(stats) else Counter()


def save_compile(db: Database, job_id: str, report: dict[str, Any],
                 lookups: Sequence[Lookup]) -> None:
    """Store the job's lookups and its plan graph (`report["graph"]`, when the report has one)."""
    with db.write() as s:
        s.execute(delete(JobLookup).where(JobLookup.job_id == job_id))
        s.execute(delete(JobPlan).where(JobPlan.job_id == job_id))
        if report.get("graph") is not None:
            s.add(JobPlan(job_id=job_id, graph=report["graph"]))
        s.add_all(JobLookup(job_id=job_id, signature=x.signature, ops=list(x.ops),
                            answer=x.answer[:64], source=x.source[:16], seconds=x.seconds)
                  for x in lookups)


def without_graph(report: dict[str, Any]) -> dict[str, Any]:
    """The report as the jobs table keeps it: the plan graph lives in job_plans."""
    return {k: v for k, v in report.items() if k != "graph"}
