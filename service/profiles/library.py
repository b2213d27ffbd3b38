"""The performance library as users see it: profile entries, summary counts, a job's plan graph.

Entries and devices are shared by every tenant; which job looked an entry's kernel up is shown
only to that job's tenant (`jobs` of an entry lists the caller's jobs only, and the `job` filter
takes only the caller's jobs).
"""
from __future__ import annotations

import json
from collections import Counter
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field
from sqlalchemy import func, select
from sqlalchemy.engine import make_url

from service.db import Database, utcnow
from service.devices import selector as sel
from service.devices.farm import devices_by_fingerprint, fingerprints_matching
from service.jobs import service as job_service
from service.jobs.tables import Job
from service.problems import APIError
from service.profiles.tables import (
    MEASURED,
    PREDICTED,
    JobLookup,
    JobPlan,
    ProfileBlock,
    ProfileEntry,
)

RECENT_JOBS = 50  # the hit rate is over the lookups of this many latest compiles
HIT_ANSWERS = ("hit",)


class EntryOut(BaseModel):
    id: int
    signature: str
    op_types: list[str] = Field(description="op types of the kernel's block, in order")
    schedule: dict[str, Any]
    device_fingerprint: str
    devices: list[str] = Field(description="names of the devices of that class")
    median_s: float
    p10_s: float
    p90_s: float
    n: int
    source: str = Field(description="measured or predicted")
    toolchain: str
    created_at: datetime
    age_s: float
    jobs: list[str] = Field(description="your jobs that looked this kernel up")


class EntryPage(BaseModel):
    total: int
    limit: int
    offset: int
    entries: list[EntryOut]


class DeviceCount(BaseModel):
    fingerprint: str
    devices: list[str]
    entries: int


class LookupStats(BaseModel):
    jobs: int = Field(description="recent compiles counted")
    lookups: int
    hits: int = Field(description="answered by an entry already in the database")
    hit_rate: float | None
    answers: dict[str, int] = Field(description="lookups by kind of answer")


class Summary(BaseModel):
    entries: int
    measured: int
    predicted: int
    signatures: int
    database_bytes: int | None = Field(description="size of the whole service database")
    per_device: list[DeviceCount]
    per_day: list[tuple[str, int]] = Field(description="(day, entries written that day), last 30")
    lookups: LookupStats


def op_types(description: str | None) -> list[str]:
    if not description:
        return []
    try:
        return [op.get("op_type", "?") for op in json.loads(description).get("ops", [])]
    except (ValueError, AttributeError):
        return []


def job_signatures(db: Database, tenant_id: str, job_id: str) -> set[str]:
    """Kernel signatures a job of the tenant looked up or compiled into blocks."""
    job_service.get(db, tenant_id, job_id)  # 404 unless it is the tenant's
    with db.read() as s:
        looked = set(s.scalars(select(JobLookup.signature).where(JobLookup.job_id == job_id)))
        plan = s.get(JobPlan, job_id)
    blocks = {b["signature"] for b in plan.graph["blocks"] if b.get("signature")} if plan else set()
    return looked | blocks


def list_entries(db: Database, tenant_id: str, *, device: sel.Selector, op_type: str | None,
                 job: str | None, source: str | None, signature: str | None, limit: int,
                 offset: int) -> EntryPage:
    E, B = ProfileEntry, ProfileBlock
    query = select(E, B.description).outerjoin(B, B.signature == E.signature)
    if device:
        query = query.where(E.device_fingerprint.in_(fingerprints_matching(db, device)))
    if source:
        query = query.where(E.source == source)
    if signature:
        query = query.where(E.signature.startswith(signature.lower()))
    if op_type:
        # canonical JSON (kiln.signature) writes `"op_type":"X"` exactly like this
        query = query.where(B.description.contains(f'"op_type":{json.dumps(op_type)}'))
    if job:
        query = query.where(E.signature.in_(job_signatures(db, tenant_id, job)))
    with db.read() as s:
        total = s.scalar(select(func.count()).select_from(query.subquery()))
        rows = s.execute(query.order_by(E.created_at.desc(), E.id).limit(limit).offset(offset)).all()
        signatures = {e.signature for e, _ in rows}
        own = s.execute(select(JobLookup.signature, JobLookup.job_id).distinct()
                        .join(Job, Job.id == JobLookup.job_id)
                        .where(JobLookup.signature.in_(signatures), Job.tenant_id == tenant_id)).all()
    jobs: dict[str, list[str]] = {}
    for sig, job_id in own:
        jobs.setdefault(sig, []).append(job_id)
    names = devices_by_fingerprint(db)
    now = utcnow()
    return EntryPage(total=int(total), limit=limit, offset=offset, entries=[EntryOut(
        id=e.id, signature=e.signature, op_types=op_types(desc), schedule=json.loads(e.schedule),
        device_fingerprint=e.device_fingerprint, devices=names.get(e.device_fingerprint, []),
        median_s=e.median_s, p10_s=e.p10_s, p90_s=e.p90_s, n=e.n, source=e.source,
        toolchain=e.toolchain, created_at=e.created_at,
        age_s=round((now - e.created_at).total_seconds(), 1),
        jobs=sorted(jobs.get(e.signature, []))) for e, desc in rows])


def lookup_stats(db: Database, recent_jobs: int = RECENT_JOBS) -> LookupStats:
    with db.read() as s:
        latest = (select(JobLookup.job_id, func.max(JobLookup.id).label("last"))
                  .group_by(JobLookup.job_id).order_by(func.max(JobLookup.id).desc())
                  .limit(recent_jobs).subquery())
        answers = Counter(dict(s.execute(
            select(JobLookup.answer, func.count()).where(JobLookup.job_id.in_(
                select(latest.c.job_id))).group_by(JobLookup.answer)).all()))
        jobs = s.scalar(select(func.count()).select_from(latest))
    total = sum(answers.values())
    hits = sum(answers[a] for a in HIT_ANSWERS)
    return LookupStats(jobs=int(jobs or 0), lookups=total, hits=hits,
                       hit_rate=round(hits / total, 4) if total else None, answers=dict(answers))


def database_bytes(db: Database) -> int | None:
    with db.read() as s:
        if db.dialect == "postgresql":
            return int(s.scalar(select(func.pg_database_size(func.current_database()))))
    path = make_url(db.url).database
    if path and path != ":memory:" and Path(path).is_file():
        return sum(Path(f).stat().st_size for f in (path, f"{path}-wal") if Path(f).is_file())
    return None


def summary(db: Database) -> Summary:
    E = ProfileEntry
    since = utcnow() - timedelta(days=30)
    with db.read() as s:
        by_source = dict(s.execute(select(E.source, func.count()).group_by(E.source)).all())
        per_fp = s.execute(select(E.device_fingerprint, func.count()).group_by(
            E.device_fingerprint).order_by(func.count().desc())).all()
        signatures = s.scalar(select(func.count(func.distinct(E.signature))))
        recent = s.scalars(select(E.created_at).where(E.created_at >= since)).all()
    days = Counter(t.date().isoformat() for t in recent)
    names = devices_by_fingerprint(db)
    return Summary(
        entries=sum(by_source.values()), measured=by_source.get(MEASURED, 0),
        predicted=by_source.get(PREDICTED, 0), signatures=int(signatures or 0),
        database_bytes=database_bytes(db),
        per_device=[DeviceCount(fingerprint=fp, devices=names.get(fp, []), entries=n)
                    for fp, n in per_fp],
        per_day=sorted(days.items()), lookups=lookup_stats(db))


def plan(db: Database, tenant_id: str, job_id: str) -> dict[str, Any]:
    """The job's fusion plan graph with its profile lookups and their answers."""
    job, _ = job_service.get(db, tenant_id, job_id)
    with db.read() as s:
        row = s.get(JobPlan, job_id)
        lookups = list(s.scalars(select(JobLookup).where(JobLookup.job_id == job_id)
                                 .order_by(JobLookup.id)))
    if row is None or job.state != "succeeded":
        if job.state == "succeeded":
            raise APIError(404, "Not Found", f"job {job_id} was compiled before Kiln kept fusion "
                           "plans; compile the model again to see its plan")
        raise APIError(409, "Conflict", f"job {job_id} has no plan: it is {job.state}")
    blocks = [{k: v for k, v in b.items() if k != "description"} for b in row.graph["blocks"]]
    return {**row.graph, "blocks": blocks, "job_id": job_id,
            "lookups": [{"ops": x.ops, "signature": x.signature, "answer": x.answer,
                         "source": x.source, "seconds": x.seconds} for x in lookups]}
