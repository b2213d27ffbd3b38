"""The API side of jobs: create (validated against the model), list, get, cancel."""
from __future__ import annotations

import hashlib
import json
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError

from service.db import Database, utcnow
from service.jobs.schemas import JobCreate
from service.jobs.tables import CANCELLED, QUEUED, RUNNING, TERMINAL, Artifact, Job
from service.limits.service import lock_tenant
from service.models import service as models
from service.problems import APIError


def check_shapes(inputs: list[dict[str, Any]], shapes: dict[str, list[int]]) -> None:
    """Refuse shapes the compiler would refuse, before anything is queued (422)."""
    by_name = {i["name"]: i for i in inputs}
    for name, dims in shapes.items():
        if name not in by_name:
            raise APIError(422, "Unprocessable Content", f"shapes: the model has no input {name!r}"
                           f" (inputs: {', '.join(by_name) or 'none'})")
        if len(dims) != len(by_name[name]["shape"]):
            raise APIError(422, "Unprocessable Content", f"shapes: input {name!r} has rank "
                           f"{len(by_name[name]['shape'])}, got {len(dims)} dimensions")
        for axis, (want, got) in enumerate(zip(by_name[name]["shape"], dims)):
            if isinstance(want, int) and want > 0 and want != got:
                raise APIError(422, "Unprocessable Content", f"shapes: dimension {axis} of input "
                               f"{name!r} is fixed at {want}, got {got}")
    for info in inputs:
        invalid = [d for d in info["shape"] if isinstance(d, int) and d <= 0]
        if invalid:  # recorded before uploads checked their dimensions
            raise APIError(422, "Unprocessable Content", f"input {info['name']!r} declares the "
                           f"invalid dimension(s) {', '.join(map(str, invalid))}; upload the model "
                           "again with positive or named (dim_param) dimensions")
        symbolic = [d for d in info["shape"] if not isinstance(d, int)]
        if symbolic and info["name"] not in shapes:
            raise APIError(422, "Unprocessable Content", f"input {info['name']!r} has symbolic "
                           f"dimension(s) {', '.join(map(repr, symbolic))}: give its shape in "
                           f"`shapes`")


def create(db: Database, tenant_id: str, request: JobCreate, max_active: int = 0) -> Job:
    """Add a queued job (429 when the tenant has `max_active` unfinished ones; 0: no cap)."""
    return create_once(db, tenant_id, request, None, max_active)[0]


def create_once(db: Database, tenant_id: str, request: JobCreate, idempotency_key: str | None,
                max_active: int = 0) -> tuple[Job, bool]:
    """Add a queued job; (job, created). With an Idempotency-Key the tenant already used for the
    same request, that job instead (created False); for another request, 422. 429 when the
    tenant has `max_active` queued or running jobs (0: no cap)."""
    digest = hashlib.sha256(json.dumps(request.model_dump(mode="json"), sort_keys=True)
                            .encode()).hexdigest()
    if idempotency_key is not None:
        earlier = _replay(db, tenant_id, idempotency_key, digest)
        if earlier is not None:
            return earlier, False
    model = models.get(db, tenant_id, request.model_id)
    check_shapes(model.inputs, request.shapes)
    try:
        with db.write() as s:
            _check_active(s, tenant_id, max_active)
            job = Job(tenant_id=tenant_id, model_id=model.id, target=request.target,
                      partitioner=request.partitioner, shapes=request.shapes,
                      rewrite=request.rewrite, tune=request.tune,
                      tune_budget_s=request.tune_budget_s, state=QUEUED, progress=0,
                      stage_seconds={}, attempts=0, enqueued_at=utcnow(),
                      idempotency_key=idempotency_key, request_sha256=digest)
            s.add(job)
    except IntegrityError:  # a concurrent request with the same key won
        earlier = _replay(db, tenant_id, idempotency_key, digest) if idempotency_key else None
        if earlier is None:
            raise
        return earlier, False
    return job, True


def _check_active(s, tenant_id: str, cap: int) -> None:
    if not cap:
        return
    lock_tenant(s, tenant_id)
    active = s.scalar(select(func.count()).select_from(Job).where(
        Job.tenant_id == tenant_id, Job.state.in_((QUEUED, RUNNING))))
    if active >= cap:
        raise APIError(429, "Too Many Requests", f"your tenant has {active} unfinished jobs, the "
                       "most allowed (KILN_MAX_ACTIVE_JOBS); wait for one to finish or cancel one",
                       headers={"Retry-After": "30"})


def _replay(db: Database, tenant_id: str, key: str, digest: str) -> Job | None:
    with db.read() as s:
        job = s.scalars(select(Job).where(Job.tenant_id == tenant_id,
                                          Job.idempotency_key == key)).first()
    if job is not None and job.request_sha256 != digest:
        raise APIError(422, "Unprocessable Content", f"Idempotency-Key {key!r} was used for "
                       f"another request (job {job.id}); use a new key for a new request")
    return job


def delete(db: Database, job_id: str) -> None:
    """Remove a job that could not be queued."""
    with db.write() as s:
        job = s.get(Job, job_id)
        if job is not None:
            s.delete(job)


def get(db: Database, tenant_id: str, job_id: str) -> tuple[Job, Artifact | None]:
    with db.read() as s:
        job = s.get(Job, job_id)
        if job is None or job.tenant_id != tenant_id:
            raise APIError(404, "Not Found", f"no job with id {job_id!r}")
        artifact = s.scalars(select(Artifact).where(Artifact.job_id == job_id)).first()
    return job, artifact


def queue_position(db: Database, job: Job) -> int | None:
    """A queued job's place in the queue: 1 + the queued jobs of every tenant created before it."""
    if job.state != QUEUED:
        return None
    with db.read() as s:
        ahead = s.scalar(select(func.count()).select_from(Job).where(
            Job.state == QUEUED, Job.created_at < job.created_at))
    return 1 + (ahead or 0)


def list_jobs(db: Database, tenant_id: str, state: str | None, limit: int,
              offset: int) -> list[tuple[Job, Artifact | None]]:
    query = (select(Job, Artifact).outerjoin(Artifact, Artifact.job_id == Job.id)
             .where(Job.tenant_id == tenant_id))
    if state:
        query = query.where(Job.state == state)
    query = query.order_by(Job.created_at.desc(), Job.id).limit(limit).offset(offset)
    with db.read() as s:
        return [(job, artifact) for job, artifact in s.execute(query)]


def cancel(db: Database, tenant_id: str, job_id: str) -> tuple[Job, bool]:
    """Cancel a queued or running job; (job, whether it was stopped by this call)."""
    with db.write() as s:
        job = s.get(Job, job_id, with_for_update=True)
        if job is None or job.tenant_id != tenant_id:
            raise APIError(404, "Not Found", f"no job with id {job_id!r}")
        if job.state == CANCELLED:
            return job, False
        if job.state in TERMINAL:
            raise APIError(409, "Conflict", f"job {job_id} has already {job.state}; only queued "
                           "or running jobs can be cancelled")
        assert job.state in (QUEUED, RUNNING)
        job.state, job.finished_at, job.error = CANCELLED, utcnow(), "cancelled by the client"
        return job, True
