from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Annotated

import anyio
from fastapi import APIRouter, Depends, Header, Request, Response
from fastapi.responses import FileResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from service.deps import DB, Config, Limit, Offset, Store, Tenant, rate_limited
from service.limits import service as limits
from service.jobs import service
from service.jobs.schemas import JobCreate, JobOut, JobState, job_out
from service.jobs.tables import TERMINAL
from service.models import service as models
from service.problems import PROBLEM_RESPONSES, APIError

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=PROBLEM_RESPONSES,
                   dependencies=[Depends(rate_limited)])
log = logging.getLogger("kiln.service")
SSE_KEEPALIVE_SECONDS = 15.0
_CONFLICT = {409: PROBLEM_RESPONSES[422] | {"description": "not possible in the job's state"}}


@router.post("", status_code=202, response_model=JobOut, summary="Compile a model",
             responses={503: PROBLEM_RESPONSES[422] | {"description": "the broker is down"}})
def create_job(body: JobCreate, request: Request, response: Response, tenant: Tenant, db: DB,
               settings: Config,
               idempotency_key: Annotated[str | None, Header(
                   alias="Idempotency-Key", min_length=1, max_length=200,
                   description="repeating a request with the same key returns the job it made "
                   "(per tenant); the same key with another request is a 422")] = None):
    """Queue a compile of one of your models; follow it at `links.events` or `links.self`."""
    job, created = service.create_once(db, tenant, body, idempotency_key,
                                        settings.max_active_jobs)
    response.headers["Location"] = f"/v1/jobs/{job.id}"
    if not created:
        response.headers["Idempotent-Replayed"] = "true"
        return job_out(*service.get(db, tenant, job.id))
    try:
        request.app.state.dispatcher.enqueue(job.id)
    except Exception as exc:
        log.exception("could not queue job %s", job.id)
        service.delete(db, job.id)
        raise APIError(503, "Service Unavailable", f"the job could not be queued: the broker is "
                       f"unreachable ({type(exc).__name__}); try again") from None
    return job_out(job)


@router.get("", response_model=list[JobOut], summary="List your jobs, newest first")
def list_jobs(tenant: Tenant, db: DB, state: JobState | None = None, limit: Limit = 100,
              offset: Offset = 0):
    return [job_out(j, a) for j, a in service.list_jobs(db, tenant, state, limit, offset)]


@router.get("/{job_id}", response_model=JobOut, summary="A job: state, stage, progress, error")
def get_job(job_id: str, tenant: Tenant, db: DB):
    job, artifact = service.get(db, tenant, job_id)
    return job_out(job, artifact, service.queue_position(db, job))


@router.post("/{job_id}/cancel", response_model=JobOut, status_code=202, responses=_CONFLICT,
             summary="Cancel a queued or running job")
def cancel_job(job_id: str, request: Request, tenant: Tenant, db: DB):
    """A queued job never starts; a running one's compile is stopped within seconds (at the
    worker's next heartbeat). Repeating is harmless."""
    job, stopped = service.cancel(db, tenant, job_id)
    if stopped:
        request.app.state.dispatcher.revoke(job_id)
    return job_out(job)


@router.get("/{job_id}/artifact", response_class=FileResponse, responses=_CONFLICT | {
    200: {"content": {"application/octet-stream": {}}, "description": "the .kiln artifact"},
    410: PROBLEM_RESPONSES[422] | {"description": "the artifact is no longer stored"}},
    summary="Download the compiled artifact")
def get_artifact(job_id: str, tenant: Tenant, db: DB, storage: Store):
    job, artifact = service.get(db, tenant, job_id)
    if artifact is None:
        raise APIError(409, "Conflict", f"job {job_id} has no artifact: it is {job.state}")
    model = models.get(db, tenant, job.model_id)
    name = f"{Path(model.filename).stem or 'model'}.kiln"
    path = storage.resolve(artifact.path)
    if not path.is_file():
        log.error("job %s: artifact %s is missing from storage", job_id, path)
        raise APIError(410, "Gone", f"the artifact of job {job_id} is no longer stored; submit "
                       "the job again to rebuild it")
    return FileResponse(path, media_type="application/octet-stream",
                        filename=name, headers={"X-Kiln-SHA256": artifact.sha256})


@router.get("/{job_id}/report", responses=_CONFLICT, summary="The fusion report of a job",
            response_model=dict)
def get_report(job_id: str, tenant: Tenant, db: DB):
    job, _ = service.get(db, tenant, job_id)
    if job.report is None:
        raise APIError(409, "Conflict", f"job {job_id} has no report: it is {job.state}")
    return job.report


@router.get("/{job_id}/events", summary="Server-sent events of a job's progress",
            response_class=StreamingResponse,
            responses={200: {"content": {"text/event-stream": {}}, "description": (
                "`event: job` with the job as JSON whenever its state, stage, progress, step or "
                "queue position changes; "
                "`event: end` once it is finished, then the stream closes")}})
async def job_events(job_id: str, tenant: Tenant, db: DB, settings: Config):
    job, artifact = await run_in_threadpool(service.get, db, tenant, job_id)  # 404 before streaming
    lease = await run_in_threadpool(limits.open_stream, db, tenant, settings.max_event_streams)

    async def stream():
        try:
            async for event in _events(job, artifact):
                yield event
        finally:
            with anyio.CancelScope(shield=True):  # the client went away: still free the lease
                await run_in_threadpool(limits.close_stream, db, lease)

    async def _events(job, artifact):
        seen, last_sent, n = None, time.monotonic(), 0
        renewed = time.monotonic()
        while True:
            out = job_out(job, artifact, await run_in_threadpool(service.queue_position, db, job))
            key = (out.state, out.stage, out.progress, out.step, out.queue_position)
            if key != seen:
                seen, n, last_sent = key, n + 1, time.monotonic()
                yield f"id: {n}\nevent: job\ndata: {out.model_dump_json()}\n\n"
            elif time.monotonic() - last_sent > SSE_KEEPALIVE_SECONDS:
                last_sent = time.monotonic()
                yield ": keepalive\n\n"
            if out.state in TERMINAL:
                yield f"event: end\ndata: {json.dumps({'state': out.state})}\n\n"
                return
            await asyncio.sleep(settings.events_poll_seconds)
            job, artifact = await run_in_threadpool(service.get, db, tenant, job_id)
            if time.monotonic() - renewed > limits.STREAM_LEASE_SECONDS / 3:
                renewed = time.monotonic()
                await run_in_threadpool(limits.renew_stream, db, lease)

    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
