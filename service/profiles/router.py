"""The performance library and profile jobs: `/v1/profiles`, `/v1/jobs/{id}/profile`, `/plan`."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request, Response

from service.deps import DB, Store, Tenant, rate_limited
from service.devices.farm_router import parse_selector
from service.problems import PROBLEM_RESPONSES, APIError
from service.profiles import library, runs

router = APIRouter(tags=["profiles"], responses=PROBLEM_RESPONSES,
                   dependencies=[Depends(rate_limited)])
_CONFLICT = {409: PROBLEM_RESPONSES[422] | {"description": "not possible in the job's state"}}
_PROFILE = _CONFLICT | {410: PROBLEM_RESPONSES[422] | {"description": "the artifact is no longer stored"}}


@router.get("/v1/profiles", response_model=library.EntryPage, summary="Search profile entries")
def list_profiles(tenant: Tenant, db: DB,
                  device: Annotated[str | None, Query(description="a device selector")] = None,
                  op_type: Annotated[str | None, Query(max_length=64)] = None,
                  job: Annotated[str | None, Query(max_length=64, description=(
                      "one of your jobs: the kernels it looked up or compiled"))] = None,
                  source: Literal["measured", "predicted"] | None = None,
                  signature: Annotated[str | None, Query(max_length=64, pattern="^[0-9a-fA-F]+$",
                                                         description="a signature prefix")] = None,
                  limit: Annotated[int, Query(ge=1, le=1000)] = 100,
                  offset: Annotated[int, Query(ge=0)] = 0):
    """Entries of the shared performance library, newest first. An entry's `jobs` lists only
    your own jobs that looked its kernel up."""
    return library.list_entries(db, tenant, device=parse_selector(device), op_type=op_type,
                                job=job, source=source, signature=signature, limit=limit,
                                offset=offset)


@router.get("/v1/profiles/summary", response_model=library.Summary,
            summary="Counts: entries per device, per day, database size, lookup hit rate")
def profiles_summary(_tenant: Tenant, db: DB):
    return library.summary(db)


@router.get("/v1/jobs/{job_id}/plan", response_model=dict[str, Any], responses=_CONFLICT,
            summary="The fusion plan of a job as a graph")
def job_plan(job_id: str, tenant: Tenant, db: DB):
    """`ops` (nodes with type, name, mapping type and block), `edges` (tensors between ops;
    `internal` ones stay inside a block), `blocks` (mapping type, anchor, kernel signature),
    `decisions` (every fusion decision with its reason) and `lookups` (each profile lookup of the
    compile: its ops, signature, answer and the estimate's source)."""
    return library.plan(db, tenant, job_id)


@router.post("/v1/jobs/{job_id}/profile", status_code=202, response_model=runs.ProfileRunOut,
             responses=_PROFILE, summary="Run a job's compiled model on a device")
def start_profile(job_id: str, body: runs.ProfileCreate, request: Request, response: Response,
                  tenant: Tenant, db: DB, storage: Store):
    """Runs the artifact on an online device matching `device` (through its agent; a host-target
    job with no matching agent device runs on a worker's CPU) and records per-kernel latencies
    with percentiles, the end-to-end latency, the memory plan's peak and the runner's measured
    peak resident memory. Follow it at `GET /v1/jobs/{id}/profile/{run id}`."""
    run = runs.start(db, storage, tenant, job_id, body)
    if run.via == runs.WORKER:
        try:
            request.app.state.dispatcher.enqueue_profile(run.id)
        except Exception as exc:
            runs.finish(db, run.id, error=f"could not be queued: {type(exc).__name__}")
            raise APIError(503, "Service Unavailable", "the profile job could not be queued: the "
                           "broker is unreachable; try again") from None
    response.headers["Location"] = f"/v1/jobs/{job_id}/profile/{run.id}"
    return run


@router.get("/v1/jobs/{job_id}/profile", response_model=list[runs.ProfileRunOut],
            summary="A job's profile runs, newest first")
def list_profile_runs(job_id: str, tenant: Tenant, db: DB):
    return runs.list_runs(db, tenant, job_id)


@router.get("/v1/jobs/{job_id}/profile/{run_id}", response_model=runs.ProfileRunOut,
            summary="One profile run")
def get_profile_run(job_id: str, run_id: str, tenant: Tenant, db: DB):
    return runs.get_run(db, tenant, job_id, run_id)
