"""The real Kiln service for the agent tests: uvicorn in its own process, SQLite or PostgreSQL.

`LiveService` starts `uvicorn --factory service.app:create_app` on a loopback port against a fresh
database, creates an agent (its token stored hashed, like `kiln admin create-agent`), queues
measurement tasks for artifacts (the way workers and bench/build_profile_db.py do) and reads back
what the agent did from the database: devices, tasks, profile entries.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from sqlalchemy import select

from kiln.runtime.artifact import read_manifest
from kiln.signature import kernel_signature
from service.db import database
from service.devices import service as devices
from service.devices.tables import Device, MeasurementTask
from service.migrate import upgrade
from service.profiles.measure import store_probe_artifact
from service.profiles.tables import ProfileEntry
from service.storage import Storage
from tests.service.stack import REPO, free_port
from tests.runtime.handmade import mlp


def mlp_kernels() -> dict[str, dict[str, str]]:
    """The handmade mlp's blocks with their kernel signatures (what the task's result files)."""
    model = mlp()
    return {b.id: {"signature": kernel_signature(model.plan.graph, b.op_ids), "schedule": "{}"}
            for b in model.plan.blocks}


class LiveService:
    def __init__(self, folder: Path, database_url: str):
        self.folder = Path(folder)
        self.database_url = database_url
        self.storage = Storage(self.folder / "storage")
        upgrade(database_url)
        self.db = database(database_url)
        _agent, self.token = devices.create_agent(self.db, "test-agent")
        self.url = ""
        self.process: subprocess.Popen | None = None

    # --- lifetime ------------------------------------------------------------------------------
    def start(self, **env: str) -> str:
        port = free_port()
        environment = {**os.environ, "KILN_DATA_DIR": str(self.folder / "data"),
                       "KILN_DATABASE_URL": self.database_url,
                       "KILN_STORAGE_ROOT": str(self.storage.root), "PYTHONPATH": str(REPO), **env}
        log = (self.folder / "api.log").open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--factory", "service.app:create_app", "--host",
             "127.0.0.1", "--port", str(port), "--log-level", "warning"],
            env=environment, cwd=REPO, stdout=log, stderr=log, start_new_session=True)
        log.close()
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the service exited:\n{self.log()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/v1/health", timeout=2).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"no answer at {self.url}")
            time.sleep(0.1)

    def log(self) -> str:
        path = self.folder / "api.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    # --- what tests set up ---------------------------------------------------------------------
    def add_task(self, artifact: Path, arch: str, runs: int = 3, repeats: int = 2,
                 kernels: dict | None = None, **extra) -> str:
        rel, sha = store_probe_artifact(self.storage, Path(artifact))
        kernels = kernels if kernels is not None else mlp_kernels()
        assert set(kernels) == {k["block"] for k in read_manifest(artifact)["kernels"]}
        return devices.create_task(self.db, artifact_path=rel, artifact_sha256=sha, arch=arch,
                                   kernels=kernels, runs=runs, repeats=repeats,
                                   toolchain="test", **extra)

    # --- what tests read -----------------------------------------------------------------------
    def devices(self) -> dict[str, Device]:
        with self.db.read() as s:
            return {d.name: d for d in s.scalars(select(Device))}

    def device_id(self, name: str) -> str:
        return self.devices()[name].id

    def tasks(self) -> dict[str, MeasurementTask]:
        with self.db.read() as s:
            return {t.id: t for t in s.scalars(select(MeasurementTask))}

    def states(self) -> set[str]:
        return {t.status for t in self.tasks().values()}

    def finished(self) -> bool:
        return self.states() <= {"done", "failed"}

    def entries(self) -> list[ProfileEntry]:
        with self.db.read() as s:
            return list(s.scalars(select(ProfileEntry)))
