"""A stand-in for the Kiln service's agent API, for testing the agent's side of the contract.

The real routes are not written yet (issue 7, part B), so this is a test double — but a real HTTP
server: a FastAPI app served by uvicorn on a loopback port, speaking exactly the contract of
device_agents.protocol (it validates every body with those models, answers 401 to a wrong token,
404 to an unknown device, 409 to a result for a task the device does not hold), with its state in
memory so tests can look at what the agent did. Claims hand a device only tasks of its
architecture, like the service will.
"""
from __future__ import annotations

import itertools
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from fastapi import Depends, FastAPI, Header, HTTPException
from fastapi.responses import FileResponse

from device_agents import protocol as p


@dataclass
class Task:
    task: p.MeasurementTask
    path: Path
    arch: str | None  # None: any device may claim it
    state: str = "queued"  # queued, claimed, done, failed
    device_id: str | None = None
    result: p.ResultUpload | None = None


@dataclass
class FakeService:
    token: str
    devices: dict[str, p.DeviceRegistration] = field(default_factory=dict)
    tasks: dict[str, Task] = field(default_factory=dict)
    heartbeats: list[p.Heartbeat] = field(default_factory=list)
    releases: list[p.ReleaseRequest] = field(default_factory=list)
    results: list[p.ResultUpload] = field(default_factory=list)
    downloads: list[str] = field(default_factory=list)
    url: str = ""

    def __post_init__(self) -> None:
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.app = self._build_app()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    # --- what tests set up and read ----------------------------------------------------------
    def add_task(self, task_id: str, artifact: Path, arch: str | None, runs: int = 3,
                 repeats: int = 2, **extra) -> None:
        import hashlib

        digest = hashlib.sha256(Path(artifact).read_bytes()).hexdigest()
        task = p.MeasurementTask(task_id=task_id, artifact_url=f"/v1/agents/artifacts/{task_id}",
                                 artifact_sha256=digest, runs=runs, repeats=repeats, **extra)
        self.tasks[task_id] = Task(task, Path(artifact), arch)

    def device_id(self, name: str) -> str:
        return next(i for i, d in self.devices.items() if d.name == name)

    def last_status(self, name: str) -> p.DeviceState | None:
        device_id = self.device_id(name)
        for beat in reversed(self.heartbeats):
            for d in beat.devices:
                if d.device_id == device_id:
                    return d.status
        return None

    def finished(self) -> bool:
        return all(t.state in ("done", "failed") for t in self.tasks.values())

    # --- the API -----------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        app = FastAPI()

        def agent(authorization: str = Header("")) -> None:
            if authorization != f"Bearer {self.token}":
                raise HTTPException(401, "unknown agent token")

        @app.post(p.REGISTER_PATH, dependencies=[Depends(agent)])
        def register(body: p.DeviceRegistration) -> p.DeviceRegistered:
            with self._lock:
                for device_id, known in self.devices.items():
                    if known.name == body.name:
                        self.devices[device_id] = body
                        return p.DeviceRegistered(device_id=device_id)
                device_id = f"dev-{next(self._ids)}"
                self.devices[device_id] = body
                return p.DeviceRegistered(device_id=device_id)

        @app.post(p.HEARTBEAT_PATH, dependencies=[Depends(agent)])
        def heartbeat(body: p.Heartbeat) -> p.HeartbeatReply:
            with self._lock:
                self.heartbeats.append(body)
                return p.HeartbeatReply(unknown_device_ids=[
                    d.device_id for d in body.devices if d.device_id not in self.devices])

        @app.post(p.CLAIM_PATH, dependencies=[Depends(agent)])
        def claim(body: p.ClaimRequest) -> p.ClaimReply:
            with self._lock:
                device = self.devices.get(body.device_id)
                if device is None:
                    raise HTTPException(404, f"unknown device {body.device_id}")
                chosen = [t for t in self.tasks.values() if t.state == "queued"
                          and t.arch in (None, device.facts.arch)][:body.max_tasks]
                for t in chosen:
                    t.state, t.device_id = "claimed", body.device_id
                return p.ClaimReply(tasks=[t.task for t in chosen])

        @app.get("/v1/agents/artifacts/{task_id}", dependencies=[Depends(agent)])
        def artifact(task_id: str) -> FileResponse:
            task = self.tasks.get(task_id)
            if task is None:
                raise HTTPException(404, "no such artifact")
            self.downloads.append(task_id)
            return FileResponse(task.path, media_type="application/octet-stream")

        @app.post(p.RESULTS_PATH, dependencies=[Depends(agent)])
        def results(body: p.ResultUpload) -> p.ResultAck:
            with self._lock:
                task = self.tasks.get(body.task_id)
                if task is None or task.state != "claimed" or task.device_id != body.device_id:
                    raise HTTPException(409, "the task is not claimed by this device")
                task.state = "done" if body.status == "ok" else "failed"
                task.result = body
                self.results.append(body)
                return p.ResultAck()

        @app.post(p.RELEASE_PATH, dependencies=[Depends(agent)])
        def release(body: p.ReleaseRequest) -> p.ReleaseReply:
            with self._lock:
                self.releases.append(body)
                released = []
                for task_id in body.task_ids:
                    task = self.tasks.get(task_id)
                    if task and task.state == "claimed" and task.device_id == body.device_id:
                        task.state, task.device_id = "queued", None
                        released.append(task_id)
                return p.ReleaseReply(released=released)

        return app

    # --- lifetime ----------------------------------------------------------------------------
    def start(self) -> str:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the fake service did not start")
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    def stop(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(10)
