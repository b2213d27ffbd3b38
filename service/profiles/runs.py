"""Profile jobs: a succeeded job's artifact run on a device that matches a selector.

`start` picks the device: an online agent device of the artifact's architecture (and ISA) that
matches the selector gets a measurement task for the whole artifact, pinned to its device class;
with none, a host-target job runs on a worker's own CPU (workers.profile_jobs). The result —
per-kernel latency summaries (median, p10, p90 over every timed run), the end-to-end latency of
the runner's invocations, the artifact's planned peak memory and the runner's measured peak
resident memory — is kept on the run, and each kernel's summary also becomes a profile entry of
that device class.
"""
from __future__ import annotations

import json
import statistics
import zipfile
from datetime import timedelta
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from device_agents import protocol as p
from device_agents.facts import has_driver_for
from kiln.signature import canonical_json
from service.db import Database, utcnow
from service.devices import selector as sel
from service.devices import service as devices
from service.devices.tables import Device, MeasurementTask
from service.jobs import service as job_service
from service.jobs.tables import SUCCEEDED, Artifact, Job
from service.problems import APIError
from service.profiles.service import NewEntry, summarize
from service.profiles.tables import JobPlan, ProfileRun
from service.storage import Storage

QUEUED, RUNNING, DONE, FAILED = "queued", "running", "succeeded", "failed"
AGENT, WORKER = "agent", "worker"
TASK_TTL = timedelta(hours=1)


class ProfileCreate(BaseModel):
    """Where and how long to run the job's compiled model."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"device": "kind:phone,arch:aarch64,feature:neon", "runs": 20, "warmup": 3, "repeats": 3}]})

    device: str = Field("", max_length=sel.MAX_SELECTOR_CHARS, description=(
        "a device selector: comma-separated key:value terms, e.g. kind:cpu,arch:x86_64 "
        "(empty: any device that can run the artifact)"))
    runs: int = Field(20, ge=1, le=1000, description="timed runs per runner invocation")
    warmup: int = Field(3, ge=0, le=1000, description="untimed runs before them")
    repeats: int = Field(3, ge=1, le=10, description="runner invocations")

    @field_validator("device")
    @classmethod
    def _parses(cls, value: str) -> str:
        try:
            return str(sel.parse(value))
        except sel.SelectorError as exc:
            raise ValueError(str(exc)) from None


class ProfileRunOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    job_id: str
    selector: str
    via: str = Field(description="agent (a device agent's device) or worker (a worker's CPU)")
    state: str = Field(description="queued, running, succeeded or failed")
    device_id: str | None
    runs: int
    warmup: int
    repeats: int
    error: str | None
    result: dict[str, Any] | None = Field(description=(
        "device, kernels [{symbol, block, name, signature, median_s, p10_s, p90_s, n}], "
        "total {median_s, p10_s, p90_s, min_s, max_s}, memory {peak_bytes (planned), "
        "measured_peak_rss_bytes (null from runners built before it was reported), …}"))
    created_at: Any
    finished_at: Any | None


# --- the artifact's kernels ----------------------------------------------------------------------

def artifact_kernels(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(manifest, [{symbol, block, schedule}] in run order) read from a stored artifact."""
    with zipfile.ZipFile(path) as archive:
        manifest = json.loads(archive.read("manifest.json"))
        plan = json.loads(archive.read("plan.json"))
    schedules = {k["block"]: profile_schedule(k.get("schedule") or {})
                 for k in plan.get("kernels", [])}
    return manifest, [{"symbol": k["symbol"], "block": k["block"],
                       "schedule": canonical_json(schedules.get(k["block"], {}))}
                      for k in manifest["kernels"]]


def profile_schedule(record: dict[str, Any]) -> dict[str, Any]:
    """The part of a kernel's plan.json record that keys its profile entries: the schedule's
    parameters. Its `stages` describe what those parameters made of the block (derived from the
    schedule and the signature, and as long as the block is big), so they are left out."""
    return {name: value for name, value in record.items() if name != "stages"}


def stored_artifact_kernels(path: Path, job_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """`artifact_kernels` of a job's stored artifact; 410 when it is gone, 409 when unreadable."""
    if not path.is_file():
        raise APIError(410, "Gone", f"the artifact of job {job_id} is no longer stored; submit "
                       "the job again to rebuild it")
    try:
        return artifact_kernels(path)
    except (zipfile.BadZipFile, KeyError, ValueError) as exc:
        raise APIError(409, "Conflict", f"the artifact of job {job_id} cannot be read "
                       f"({type(exc).__name__}: {exc}); submit the job again to rebuild it"
                       ) from None


def block_info(db: Database, job_id: str) -> dict[str, dict[str, Any]]:
    with db.read() as s:
        plan = s.get(JobPlan, job_id)
    if plan is None:
        raise APIError(409, "Conflict", f"job {job_id} was compiled before Kiln kept fusion plans; "
                       "compile the model again to profile it")
    return {b["id"]: b for b in plan.graph["blocks"]}


# --- starting a run ------------------------------------------------------------------------------

def _job_artifact(db: Database, tenant_id: str, job_id: str) -> tuple[Job, Artifact]:
    job, artifact = job_service.get(db, tenant_id, job_id)
    if job.state != SUCCEEDED or artifact is None:
        raise APIError(409, "Conflict", f"job {job_id} is {job.state}: only a succeeded job's "
                       "artifact can be profiled")
    return job, artifact


def candidates(db: Database, selector: sel.Selector, manifest: dict[str, Any]) -> list[Device]:
    """Online agent devices that can run the artifact and match the selector, freshest first."""
    arch, isa = manifest["target"]["arch"], set(manifest["target"].get("isa") or ())
    name = manifest["target"]["name"]
    return [d for d in devices.online_devices_for(db, arch, manifest["target"].get("gpu_arch", ""))
            if d.transport != WORKER and isa <= set((d.facts or {}).get("isa") or ())
            and has_driver_for(d.facts or {}, name) and selector.matches(d)]


def start(db: Database, storage: Storage, tenant_id: str, job_id: str,
          body: ProfileCreate) -> ProfileRun:
    job, artifact = _job_artifact(db, tenant_id, job_id)
    selector = sel.parse(body.device)
    manifest, kernels = stored_artifact_kernels(storage.resolve(artifact.path), job_id)
    blocks = block_info(db, job_id)
    found = candidates(db, selector, manifest)
    run = ProfileRun(job_id=job.id, tenant_id=tenant_id, selector=str(selector), state=QUEUED,
                     runs=body.runs, warmup=body.warmup, repeats=body.repeats)
    if found:
        device = found[0]
        run.via, run.device_id = AGENT, device.id
        run.task_id = devices.create_task(
            db, artifact_path=artifact.path, artifact_sha256=artifact.sha256,
            arch=manifest["target"]["arch"], gpu_arch=manifest["target"].get("gpu_arch", ""),
            device_fingerprint=device.fingerprint,
            kernels={k["block"]: {"signature": blocks[k["block"]]["signature"],
                                  "schedule": k["schedule"],
                                  "description": blocks[k["block"]].get("description")}
                     for k in kernels},
            runs=body.runs, warmup=body.warmup, repeats=body.repeats, priority=20,
            deadline=utcnow() + TASK_TTL, max_attempts=3)
    elif job.target == "host":
        run.via = WORKER
    else:
        raise APIError(422, "Unprocessable Content", f"no online device matches "
                       f"{str(selector) or 'any device'} and can run a {job.target} artifact "
                       f"({manifest['target']['arch']}); GET /v1/devices lists the farm")
    with db.write() as s:
        s.add(run)
    return run


# --- results -------------------------------------------------------------------------------------

def kernel_rows(kernels: list[dict[str, Any]], blocks: dict[str, dict[str, Any]],
                samples: dict[str, list[float]]) -> list[dict[str, Any]]:
    rows = []
    for k in kernels:
        summary = summarize(samples[k["block"]])
        block = blocks.get(k["block"], {})
        rows.append({"symbol": k["symbol"], "block": k["block"], "name": block.get("name"),
                     "signature": block.get("signature"), "schedule": k["schedule"],
                     "median_s": summary.median_s, "p10_s": summary.p10_s,
                     "p90_s": summary.p90_s, "n": summary.n})
    return rows


def total_row(totals: list[p.LatencySummary]) -> dict[str, float]:
    return {"median_s": statistics.median(t.median_s for t in totals),
            "p10_s": statistics.median(t.p10_s for t in totals),
            "p90_s": statistics.median(t.p90_s for t in totals),
            "min_s": min(t.min_s for t in totals), "max_s": max(t.max_s for t in totals)}


def memory_row(manifest: dict[str, Any], peak_rss_bytes: int | None) -> dict[str, Any]:
    """The artifact's memory plan (the runner allocates exactly this, so it is the run's peak of
    tensor memory) beside the runner process's measured peak resident memory (the plan plus its
    code and the C runtime; the largest of its invocations)."""
    memory = manifest.get("memory") or {}
    return {"peak_bytes": manifest.get("peak_memory_bytes"), **memory,
            "measured_peak_rss_bytes": peak_rss_bytes}


def device_row(device: Device) -> dict[str, Any]:
    return {"id": device.id, "name": device.name, "kind": device.kind, "arch": device.arch,
            "fingerprint": device.fingerprint, "transport": device.transport}


def result_of(manifest: dict[str, Any], kernels: list[dict[str, Any]],
              blocks: dict[str, dict[str, Any]], device: Device, kernel_samples: list,
              totals: list, threads: int, emulated: bool,
              peak_rss_bytes: int | None) -> dict[str, Any]:
    samples = {k.block: list(k.run_samples_s) or list(k.samples_s) for k in kernel_samples}
    return {"device": device_row(device), "kernels": kernel_rows(kernels, blocks, samples),
            "total": total_row(totals), "memory": memory_row(manifest, peak_rss_bytes),
            "threads": threads, "emulated": emulated}


def absorb_task_result(s: Session, task: MeasurementTask, device: Device,
                       body: p.ResultUpload, storage: Storage | None = None) -> None:
    """In submit_result's transaction: a finished task that belongs to a profile run ends it."""
    run = s.scalars(select(ProfileRun).where(ProfileRun.task_id == task.id)).first()
    if run is None:
        return
    run.finished_at, run.device_id = utcnow(), device.id
    if body.status == "failed":
        run.state, run.error = FAILED, body.error
        return
    plan = s.get(JobPlan, run.job_id)
    blocks = {b["id"]: b for b in plan.graph["blocks"]} if plan else {}
    kernels = [{"symbol": k.symbol, "block": k.block,
                "schedule": (task.kernels.get(k.block) or {}).get("schedule", "{}")}
               for k in body.kernels]
    manifest = {}
    if storage is not None:
        try:
            manifest = artifact_kernels(storage.resolve(task.artifact_path))[0]
        except (OSError, KeyError, ValueError, zipfile.BadZipFile):
            manifest = {}
    run.state, run.error = DONE, None
    run.result = result_of(manifest, kernels, blocks, device, list(body.kernels),
                           list(body.totals), body.threads, body.emulated,
                           body.peak_rss_bytes)


def sync(db: Database, run: ProfileRun) -> ProfileRun:
    """An agent run whose task failed, expired or lost its device fails with the task's error."""
    if run.via != AGENT or run.state not in (QUEUED, RUNNING) or run.task_id is None:
        return run
    with db.write() as s:
        row = s.get(ProfileRun, run.id)
        task = s.get(MeasurementTask, run.task_id)
        if task is None:
            row.state, row.error, row.finished_at = FAILED, "its measurement task is gone", utcnow()
        elif task.status in (devices.FAILED, devices.EXPIRED):
            row.state, row.finished_at = FAILED, utcnow()
            row.error = task.error or f"the measurement task {task.status}"
        elif task.status == devices.CLAIMED and row.state == QUEUED:
            row.state, row.device_id = RUNNING, task.device_id
        return row


def list_runs(db: Database, tenant_id: str, job_id: str) -> list[ProfileRun]:
    job_service.get(db, tenant_id, job_id)  # 404 unless it is the tenant's
    with db.read() as s:
        runs = list(s.scalars(select(ProfileRun).where(ProfileRun.job_id == job_id)
                              .order_by(ProfileRun.created_at.desc(), ProfileRun.id)))
    return [sync(db, r) for r in runs]


def get_run(db: Database, tenant_id: str, job_id: str, run_id: str) -> ProfileRun:
    job_service.get(db, tenant_id, job_id)  # 404 unless it is the tenant's
    with db.read() as s:
        run = s.get(ProfileRun, run_id)
    if run is None or run.job_id != job_id:
        raise APIError(404, "Not Found", f"job {job_id} has no profile run {run_id!r}")
    return sync(db, run)


# --- the worker's side ---------------------------------------------------------------------------

def claim_for_worker(db: Database, run_id: str) -> ProfileRun | None:
    """The run, now running, unless it has finished. A running one is taken again: its message
    comes back only when the worker that ran it died (or the broker gave up waiting for it)."""
    with db.write() as s:
        changed = s.execute(update(ProfileRun).where(
            ProfileRun.id == run_id, ProfileRun.state.in_((QUEUED, RUNNING)),
            ProfileRun.via == WORKER).values(state=RUNNING)).rowcount
        return s.get(ProfileRun, run_id) if changed else None


def finish(db: Database, run_id: str, *, result: dict[str, Any] | None = None,
           error: str | None = None, device_id: str | None = None,
           entries: tuple[str, list[NewEntry]] | None = None) -> None:
    from service.profiles.service import upsert_entries

    with db.write() as s:
        run = s.get(ProfileRun, run_id)
        run.state = DONE if error is None else FAILED
        run.result, run.error, run.finished_at = result, error, utcnow()
        run.device_id = device_id or run.device_id
        if entries is not None:
            upsert_entries(s, *entries)
