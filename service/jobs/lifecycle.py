"""The worker side of a job: claim, heartbeat, stages, success or failure, requeue when stale.

Each claim increments `attempts`, and every later write of that run is fenced by it
(`WHERE id = ? AND attempts = ? AND state = 'running'`). A re-delivered message, a retried task
or a requeued stale job can therefore run the compile again, but only the run holding the current
claim records stages and only it can move the job to succeeded and install its artifact.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import select, update

from service.db import Database, utcnow
from service.jobs.tables import FAILED, QUEUED, RUNNING, SUCCEEDED, TERMINAL, Artifact, Job
from service.models.tables import ModelRecord
from service.storage import Storage

# Progress (0–100) when each compiler stage starts; 100 once the artifact is recorded.
STAGE_PROGRESS = {"load": 0, "frontend": 5, "rewrite": 25, "plan": 30, "tune": 35, "codegen": 45,
                  "build": 70}


@dataclass(frozen=True)
class Claim:
    job_id: str
    attempt: int
    model_sha256: str
    model_filename: str
    target: str
    partitioner: str
    shapes: dict[str, list[int]] = field(default_factory=dict)
    rewrite: bool = True
    tune: str = "reuse"
    tune_budget_s: float | None = None


def _fence(job_id: str, attempt: int):
    return (Job.id == job_id, Job.attempts == attempt, Job.state == RUNNING)


def claim(db: Database, job_id: str, worker: str, stale_after: float,
          max_attempts: int) -> Claim | None:
    """Take the job for this run, or None: done, cancelled, unknown, or held by a live run."""
    now = utcnow()
    with db.write() as s:
        job = s.get(Job, job_id, with_for_update=True)
        if job is None or job.state in TERMINAL:
            return None
        if job.state == RUNNING and job.heartbeat_at and \
                job.heartbeat_at > now - timedelta(seconds=stale_after):
            return None
        if job.attempts >= max_attempts:
            job.state, job.finished_at = FAILED, now
            job.error = (f"the job was started {job.attempts} times and each time its worker "
                         "stopped before finishing (crash or lost connection)")
            return None
        model = s.get(ModelRecord, job.model_id)
        job.state, job.worker, job.heartbeat_at = RUNNING, worker, now
        job.attempts += 1
        job.started_at = job.started_at or now
        job.stage, job.progress, job.stage_seconds, job.error = None, 0, {}, None
        job.step_done = job.step_total = job.step_text = None
        return Claim(job.id, job.attempts, model.sha256, model.filename, job.target,
                     job.partitioner, dict(job.shapes or {}), job.rewrite, job.tune or "off",
                     job.tune_budget_s)


def heartbeat(db: Database, job_id: str, attempt: int) -> bool:
    """Say the run is alive; False when the job was cancelled or taken over."""
    with db.write() as s:
        result = s.execute(update(Job).where(*_fence(job_id, attempt)).values(heartbeat_at=utcnow()))
        return result.rowcount == 1


def record_stage(db: Database, job_id: str, attempt: int, stage: str,
                 stage_seconds: dict[str, float]) -> bool:
    values: dict[str, Any] = {"stage": stage, "stage_seconds": stage_seconds,
                              "heartbeat_at": utcnow(), **_NO_STEP}
    if stage in STAGE_PROGRESS:
        values["progress"] = STAGE_PROGRESS[stage]
    with db.write() as s:
        return s.execute(update(Job).where(*_fence(job_id, attempt)).values(**values)).rowcount == 1


_NO_STEP = {"step_done": None, "step_total": None, "step_text": None}
STEP_TEXT_MAX = 200


def record_progress(db: Database, job_id: str, attempt: int, stage: str, done: int, total: int,
                    what: str) -> bool:
    """Progress within a stage (the compiler's on_progress): `done` of `total` steps (a total of
    0: not known in advance), `what` the one in hand. With a total, the job's percentage moves
    from the stage's start towards the next stage's."""
    done, total = max(int(done), 0), max(int(total), 0)
    values: dict[str, Any] = {"step_done": min(done, total) if total else done,
                              "step_total": total or None, "step_text": str(what)[:STEP_TEXT_MAX]}
    if total and stage in STAGE_PROGRESS:
        start = STAGE_PROGRESS[stage]
        end = min((p for p in STAGE_PROGRESS.values() if p > start), default=100)
        values["progress"] = start + (end - 1 - start) * min(done, total) // total
    with db.write() as s:
        return s.execute(update(Job).where(*_fence(job_id, attempt)).values(**values)).rowcount == 1


def succeed(db: Database, storage: Storage, claim: Claim, built: Path, report: dict[str, Any],
            stage_seconds: dict[str, float], sha256: str) -> bool:
    """Install the built artifact and mark the job succeeded, if this run still holds it."""
    now = utcnow()
    with db.write() as s:
        job = s.get(Job, claim.job_id, with_for_update=True)
        if job is None or job.state != RUNNING or job.attempts != claim.attempt:
            return False
        size = built.stat().st_size
        storage.install_artifact(built, job.id)
        existing = s.scalars(select(Artifact).where(Artifact.job_id == job.id)).first()
        if existing is None:
            s.add(Artifact(job_id=job.id, tenant_id=job.tenant_id,
                           path=storage.artifact_relpath(job.id), sha256=sha256, size_bytes=size))
        else:
            existing.sha256, existing.size_bytes, existing.created_at = sha256, size, now
        job.state, job.progress, job.finished_at = SUCCEEDED, 100, now
        job.report, job.stage_seconds, job.heartbeat_at = report, stage_seconds, now
        return True


def fail(db: Database, claim: Claim, message: str, stage_seconds: dict[str, float]) -> bool:
    with db.write() as s:
        result = s.execute(update(Job).where(*_fence(claim.job_id, claim.attempt)).values(
            state=FAILED, error=message, finished_at=utcnow(), stage_seconds=stage_seconds))
        return result.rowcount == 1


def release(db: Database, claim: Claim) -> bool:
    """Give the job back to the queue (a transient failure; the task retries)."""
    with db.write() as s:
        result = s.execute(update(Job).where(*_fence(claim.job_id, claim.attempt)).values(
            state=QUEUED, worker=None, heartbeat_at=None, enqueued_at=utcnow()))
        return result.rowcount == 1


def requeue_stale(db: Database, stale_after: float, max_attempts: int) -> list[str]:
    """Put running jobs whose run went silent back to queued; return their ids (to enqueue).

    A job whose runs were lost `max_attempts` times is failed instead.
    """
    cutoff = utcnow() - timedelta(seconds=stale_after)
    with db.read() as s:
        stale = list(s.execute(select(Job.id, Job.attempts).where(
            Job.state == RUNNING, Job.heartbeat_at < cutoff)))
    requeued = []
    for job_id, attempts in stale:
        give_up = attempts >= max_attempts
        values: dict[str, Any] = {"worker": None, "heartbeat_at": None}
        if give_up:
            values |= {"state": FAILED, "finished_at": utcnow(), "error": (
                f"the job was started {attempts} times and each time its worker stopped before "
                "finishing (crash or lost connection)")}
        else:
            values |= {"state": QUEUED, "enqueued_at": utcnow()}
        with db.write() as s:
            changed = s.execute(update(Job).where(
                Job.id == job_id, Job.state == RUNNING, Job.attempts == attempts,
                Job.heartbeat_at < cutoff).values(**values)).rowcount
        if changed and not give_up:
            requeued.append(job_id)
    return requeued


def resend_queued(db: Database, older_than: float) -> list[str]:
    """Queued jobs whose message was sent `older_than` seconds ago: claim a resend for each.

    A message can be lost (a broker restarted without persistence, a worker killed between
    taking a message and claiming its job); sending again is harmless, since claims are atomic.
    """
    cutoff = utcnow() - timedelta(seconds=older_than)
    with db.read() as s:
        waiting = list(s.scalars(select(Job.id).where(Job.state == QUEUED,
                                                      Job.enqueued_at < cutoff)))
    resend = []
    for job_id in waiting:
        with db.write() as s:
            if s.execute(update(Job).where(Job.id == job_id, Job.state == QUEUED,
                                           Job.enqueued_at < cutoff)
                         .values(enqueued_at=utcnow())).rowcount:
                resend.append(job_id)
    return resend


def give_up(db: Database, job_id: str, message: str) -> bool:
    """Fail a queued job whose task ran out of retries."""
    with db.write() as s:
        return s.execute(update(Job).where(Job.id == job_id, Job.state == QUEUED).values(
            state=FAILED, error=message, finished_at=utcnow())).rowcount == 1
