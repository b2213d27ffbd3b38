"""Profile jobs on a worker's own CPU: a host-target job's artifact, when no agent device matches.

The task takes the run id (service.profiles.runs); a run that is not queued any more is skipped,
so a re-delivered message is harmless. The worker registers its CPU as a device (transport
`worker`) and measures the artifact with the agents' own code (device_agents.measure, local
backend), so its figures are comparable with an agent's.
"""
from __future__ import annotations

import asyncio
import logging
import re
import socket
import tempfile
from pathlib import Path

from sqlalchemy import select

from service.db import Database
from service.devices import selector as sel
from service.devices import service as devices
from service.profiles import runs
from service.profiles.measure import local_facts
from service.jobs.tables import Artifact
from service.profiles.service import NewEntry, Summary
from service.settings import Settings
from service.storage import Storage
from workers.app import PROFILE_TASK, app

log = logging.getLogger("kiln.worker")


def worker_device_name() -> str:
    return "worker-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", socket.gethostname())[:50]


def _measure(artifact_path: Path, work: Path, run) -> object:
    from device_agents.backends.local import LocalBackend
    from device_agents.measure import measure
    from kiln.runtime.artifact import open_artifact

    artifact = open_artifact(artifact_path, work / "artifacts")

    async def go():
        backend = LocalBackend(work / "device", name="worker")
        try:
            return await measure(backend, local_facts(), artifact, runs=run.runs,
                                 warmup=run.warmup, repeats=run.repeats, cache_dir=work / "cache")
        finally:
            await backend.close()

    return asyncio.run(go())


def run_profile(settings: Settings, db: Database, run_id: str) -> str:
    """Run a queued worker profile run; what happened (for logs and tests)."""
    run = runs.claim_for_worker(db, run_id)
    if run is None:
        return "skipped"
    storage = Storage(settings.storage_root)
    try:
        device = devices.register_worker_device(db, worker_device_name(), local_facts())
        selector = sel.parse(run.selector)
        if not selector.matches(device):
            runs.finish(db, run_id, device_id=None, error=(
                f"no device matches {run.selector}: no agent device of the artifact's "
                f"architecture is online, and this worker's CPU ({device.name}, {device.kind}, "
                f"{device.arch}) does not match either"))
            return "failed"
        with db.read() as s:
            artifact = s.scalars(select(Artifact).where(Artifact.job_id == run.job_id)).first()
        path = storage.resolve(artifact.path)
        manifest, kernels = runs.artifact_kernels(path)
        blocks = runs.block_info(db, run.job_id)
        with tempfile.TemporaryDirectory(prefix="kiln-profile-", dir=storage.tmp) as tmp:
            m = _measure(path, Path(tmp), run)
        result = runs.result_of(manifest, kernels, blocks, device, m.kernels, m.totals,
                                m.threads, m.emulated, m.peak_rss_bytes)
        entries = [NewEntry(k["signature"], k["schedule"],
                            Summary(k["median_s"], k["p10_s"], k["p90_s"], k["n"]),
                            toolchain=manifest["target"]["cc"],
                            description=blocks[k["block"]].get("description"))
                   for k in result["kernels"] if k["signature"]]
        runs.finish(db, run_id, result=result, device_id=device.id,
                    entries=(device.fingerprint, entries))
        return "succeeded"
    except Exception as exc:  # noqa: BLE001 - the run fails with the reason; the worker goes on
        log.exception("profile run %s failed", run_id)
        runs.finish(db, run_id, error=f"{type(exc).__name__}: {exc}")
        return "failed"


@app.task(name=PROFILE_TASK, acks_late=True, reject_on_worker_lost=True)
def profile_job(run_id: str) -> str:
    from service.db import database

    outcome = run_profile(app.kiln_settings, database(app.kiln_settings.database_url), run_id)
    log.info("profile run %s: %s", run_id, outcome)
    return outcome
