"""The agent routes: exactly the contract of device_agents.protocol, under /v1/agents.

Every route needs the agent's own token (`Authorization: Bearer kagent_…`); a missing, unknown or
revoked token gets 401 problem+json before the body is looked at, so nothing is stored.
"""
from __future__ import annotations

import functools
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import FileResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from device_agents import protocol as p
from service.deps import DB, Config, Store
from service.devices import service
from service.profiles import runs
from service.problems import PROBLEM_RESPONSES, APIError

MAX_BODY_BYTES = 64 << 20  # a result at the protocol's limits fits with room to spare


def install_body_limit(app) -> None:
    """Refuse agent requests without a length or over MAX_BODY_BYTES before reading their body."""
    from service.problems import problem_response

    @app.middleware("http")
    async def _bounded(request: Request, call_next):
        if request.method == "POST" and request.url.path.startswith(p.PREFIX + "/"):
            length = request.headers.get("content-length")
            if length is None:
                return problem_response(411, "Length Required",
                                        "agent requests need a Content-Length", request.url.path)
            if not length.isdigit() or int(length) > MAX_BODY_BYTES:
                return problem_response(413, "Content Too Large", f"request body of {length} "
                                        f"bytes; at most {MAX_BODY_BYTES}", request.url.path)
        return await call_next(request)


router = APIRouter(prefix=p.PREFIX, tags=["agents"], responses={
    **PROBLEM_RESPONSES, 409: PROBLEM_RESPONSES[422] | {"description": "the task is not held"}})
_bearer = HTTPBearer(auto_error=False, description="an agent token: `Authorization: Bearer kagent_…`")
ARTIFACT_PATH = f"{p.PREFIX}/tasks/{{task_id}}/artifact"


def current_agent(request: Request,
                  bearer: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> str:
    challenge = {"WWW-Authenticate": 'Bearer realm="kiln-agents"'}
    if bearer is None or not bearer.credentials:
        raise APIError(401, "Unauthorized", "missing agent token: send `Authorization: Bearer "
                       "<agent token>` (kiln admin create-agent NAME makes one)", headers=challenge)
    agent = service.agent_for_token(request.app.state.db, bearer.credentials)
    if agent is None:
        raise APIError(401, "Unauthorized", "invalid or revoked agent token", headers=challenge)
    return agent


AgentId = Annotated[str, Depends(current_agent)]


def _call(fn, *args):
    try:
        return fn(*args)
    except service.AgentError as exc:
        titles = {404: "Not Found", 409: "Conflict", 422: "Unprocessable Content"}
        raise APIError(exc.status, titles.get(exc.status, "Error"), str(exc)) from None


@router.post("/devices", summary="Register a device")
def register(body: p.DeviceRegistration, agent: AgentId, db: DB) -> p.DeviceRegistered:
    return p.DeviceRegistered(device_id=_call(service.register, db, agent, body))


@router.post("/heartbeat", summary="Device statuses")
def heartbeat(body: p.Heartbeat, agent: AgentId, db: DB, settings: Config) -> p.HeartbeatReply:
    unknown = _call(service.heartbeat, db, agent, body, settings.agent_lease_seconds)
    return p.HeartbeatReply(unknown_device_ids=unknown)


@router.post("/claim", summary="Claim measurement tasks for a device")
def claim(body: p.ClaimRequest, agent: AgentId, db: DB, settings: Config) -> p.ClaimReply:
    tasks = _call(service.claim, db, agent, body.device_id, body.max_tasks,
                  settings.agent_lease_seconds, settings.device_offline_after_seconds)
    return p.ClaimReply(tasks=[p.MeasurementTask(
        task_id=t.id, artifact_url=ARTIFACT_PATH.format(task_id=t.id),
        artifact_sha256=t.artifact_sha256, runs=t.runs, warmup=t.warmup, repeats=t.repeats,
        threads=t.threads, timeout_s=t.timeout_s) for t in tasks])


@router.get("/tasks/{task_id}/artifact", summary="The kernel bundle of a claimed task",
            response_class=FileResponse)
def artifact(task_id: str, agent: AgentId, db: DB, storage: Store) -> FileResponse:
    task = _call(service.task_for_download, db, agent, task_id)
    path = storage.resolve(task.artifact_path)
    if not path.is_file():
        raise APIError(404, "Not Found", f"the artifact of task {task_id} is missing from storage")
    return FileResponse(path, media_type="application/octet-stream")


@router.post("/results", summary="The result of a claimed task")
def results(body: p.ResultUpload, agent: AgentId, db: DB, storage: Store) -> p.ResultAck:
    _call(service.submit_result, db, agent, body,
          functools.partial(runs.absorb_task_result, storage=storage))
    return p.ResultAck()


@router.post("/release", summary="Give claimed tasks back to the queue")
def release(body: p.ReleaseRequest, agent: AgentId, db: DB) -> p.ReleaseReply:
    return p.ReleaseReply(released=_call(service.release, db, agent, body))
