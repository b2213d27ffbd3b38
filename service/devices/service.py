"""Agents, devices and measurement tasks: what the agent routes and the workers do to them.

Claims are atomic: on PostgreSQL the candidate rows are picked with `FOR UPDATE SKIP LOCKED` inside
the claiming UPDATE, so concurrent claims never hand out one task twice and never wait on each
other; on SQLite the same UPDATE runs in a `BEGIN IMMEDIATE` transaction (one writer at a time).
Leases: a claim holds a task for `lease_s`; every heartbeat that lists the task extends it. A lease
that runs out, a release, or the device going offline (reported, or silent for
`offline_after_s`) returns the task to the queue; after `max_attempts` claims it fails instead.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from device_agents import protocol as p
from device_agents.matching import (
    capability_number,
    device_capability,
    gpu_arch_number,
    gpu_mismatch,
)
from device_agents.facts import device_class
from service.db import Database, utcnow
from service.devices.tables import Agent, Device, MeasurementTask
from service.profiles.service import NewEntry, ProfileError, summarize, upsert_entries

# What a finished task sets off in submit_result's transaction: (session, task, device, result).
TaskFinished = Callable[[Session, MeasurementTask, Device, p.ResultUpload], None]

TOKEN_PREFIX = "kagent_"
QUEUED, CLAIMED, DONE, FAILED, EXPIRED = "queued", "claimed", "done", "failed", "expired"
FINISHED = (DONE, FAILED, EXPIRED)


class AgentError(Exception):
    """An operation on agents, devices or tasks that cannot be done; `status` is its HTTP code."""

    def __init__(self, message: str, status: int = 422):
        super().__init__(message)
        self.status = status


# --- agents and tokens -------------------------------------------------------------------------

def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create_agent(db: Database, name: str) -> tuple[Agent, str]:
    """A new agent and its token (the only time the token is seen in clear)."""
    name = name.strip()
    if not name or len(name) > 200:
        raise AgentError("an agent needs a name of 1 to 200 characters")
    prefix = secrets.token_hex(6)
    token = f"{TOKEN_PREFIX}{prefix}_{secrets.token_urlsafe(32)}"
    try:
        with db.write() as s:
            agent = Agent(name=name, token_prefix=prefix, token_hash=hash_token(token))
            s.add(agent)
            s.flush()
    except IntegrityError:
        raise AgentError(f"an agent named {name!r} exists already", 409) from None
    return agent, token


def revoke_agent(db: Database, name_or_id: str) -> bool:
    with db.write() as s:
        agent = s.scalars(select(Agent).where(
            (Agent.id == name_or_id) | (Agent.name == name_or_id))).first()
        if agent is None:
            return False
        agent.revoked_at = utcnow()
        for device in s.scalars(select(Device).where(Device.agent_id == agent.id)):
            _set_offline(s, device, "its agent was revoked", utcnow())
        return True


def agent_for_token(db: Database, token: str) -> str | None:
    """The id of the agent whose valid, unrevoked token this is; None otherwise."""
    if not token.startswith(TOKEN_PREFIX):
        return None
    prefix, sep, _secret = token[len(TOKEN_PREFIX):].partition("_")
    if not sep:
        return None
    with db.read() as s:
        agent = s.scalars(select(Agent).where(Agent.token_prefix == prefix)).first()
    if agent is None or agent.revoked_at is not None:
        return None
    return agent.id if hmac.compare_digest(agent.token_hash, hash_token(token)) else None


# --- devices -----------------------------------------------------------------------------------

def register(db: Database, agent_id: str, body: p.DeviceRegistration) -> str:
    """Register or update the agent's device `body.name`; its id."""
    if body.facts.fingerprint != body.fingerprint:  # the model checks it too; never trust one side
        raise AgentError("fingerprint does not match the facts")
    now = utcnow()
    facts = body.facts.model_dump(mode="json")
    with db.write() as s:
        device = s.scalars(select(Device).where(Device.agent_id == agent_id,
                                                Device.name == body.name)).first()
        if device is None:
            device = Device(agent_id=agent_id, name=body.name)
            s.add(device)
        device.transport, device.address = body.transport, body.address
        device.kind, device.arch = body.facts.kind, body.facts.arch
        device.fingerprint, device.facts = body.fingerprint, facts
        device.emulated = body.facts.emulated
        # A device registers when its agent (re)connects to it: work it held before is lost.
        for task in s.scalars(select(MeasurementTask).where(
                MeasurementTask.device_id == device.id, MeasurementTask.status == CLAIMED)):
            _requeue(task, f"device {body.name} registered again", now)
        device.status, device.error, device.last_heartbeat_at = p.DeviceState.online.value, None, now
        s.execute(update(Agent).where(Agent.id == agent_id).values(
            last_seen_at=now, version=body.agent_version))
        s.flush()
        return device.id


def _set_offline(s: Session, device: Device, reason: str | None, now: datetime) -> list[str]:
    device.status, device.error = p.DeviceState.offline.value, reason
    held = list(s.scalars(select(MeasurementTask).where(
        MeasurementTask.device_id == device.id, MeasurementTask.status == CLAIMED)))
    return [_requeue(t, f"device {device.name} went offline: {reason}", now) for t in held]


def _requeue(task: MeasurementTask, why: str, now: datetime) -> str:
    task.device_id, task.lease_expires_at, task.claimed_at = None, None, None
    if task.attempts >= task.max_attempts:
        task.status, task.finished_at = FAILED, now
        task.error = f"gave up after {task.attempts} claims; the last ended: {why}"[:4000]
    else:
        task.status = QUEUED
    return task.id


def heartbeat(db: Database, agent_id: str, body: p.Heartbeat, lease_s: float) -> list[str]:
    """Record each device's status; extend the leases of the tasks it lists; unknown device ids."""
    now = utcnow()
    ids = [d.device_id for d in body.devices]
    with db.write() as s:
        known = {d.id: d for d in s.scalars(select(Device).where(Device.id.in_(ids),
                                                                 Device.agent_id == agent_id))}
        for beat in body.devices:
            device = known.get(beat.device_id)
            if device is None:
                continue
            device.last_heartbeat_at = now
            if beat.status == p.DeviceState.offline:
                if device.status != p.DeviceState.offline.value or beat.error != device.error:
                    _set_offline(s, device, beat.error or "reported offline", now)
                continue
            device.status, device.error = beat.status.value, None
            if beat.task_ids:
                s.execute(update(MeasurementTask).where(
                    MeasurementTask.id.in_(beat.task_ids), MeasurementTask.device_id == device.id,
                    MeasurementTask.status == CLAIMED).values(
                        lease_expires_at=now + timedelta(seconds=lease_s)))
        s.execute(update(Agent).where(Agent.id == agent_id).values(
            last_seen_at=now, version=body.agent_version))
    return [i for i in ids if i not in known]


def reap(db: Database, offline_after_s: float, now: datetime | None = None) -> list[str]:
    """Silent devices go offline, expired leases and deadlines end: the ids of requeued tasks."""
    now = now or utcnow()
    requeued: list[str] = []
    with db.write() as s:
        silent = s.scalars(select(Device).where(
            Device.status != p.DeviceState.offline.value,
            or_(Device.last_heartbeat_at.is_(None),
                Device.last_heartbeat_at < now - timedelta(seconds=offline_after_s))))
        for device in silent:
            requeued += _set_offline(s, device, f"no heartbeat for {offline_after_s:g} s", now)
        for task in s.scalars(select(MeasurementTask).where(
                MeasurementTask.status == CLAIMED, MeasurementTask.lease_expires_at < now)):
            requeued.append(_requeue(task, "its lease expired", now))
        s.execute(update(MeasurementTask).where(
            MeasurementTask.status == QUEUED, MeasurementTask.deadline < now).values(
                status=EXPIRED, finished_at=now, error="nobody measured it before its deadline"))
    return requeued


def _device_of(s: Session, agent_id: str, device_id: str) -> Device:
    device = s.get(Device, device_id)
    if device is None or device.agent_id != agent_id:
        raise AgentError(f"unknown device {device_id!r}", 404)
    return device


def claim(db: Database, agent_id: str, device_id: str, max_tasks: int, lease_s: float,
          offline_after_s: float) -> list[MeasurementTask]:
    """Atomically hand up to `max_tasks` queued tasks the device can run to it."""
    reap(db, offline_after_s)
    now = utcnow()
    with db.write() as s:
        device = _device_of(s, agent_id, device_id)
        if device.status == p.DeviceState.offline.value:
            raise AgentError(f"device {device_id} is offline; register it again first", 409)
        T = MeasurementTask
        capability = device_capability(device.facts or {})
        gpu = T.gpu_capability.is_(None) if capability is None else or_(
            T.gpu_capability.is_(None), T.gpu_capability <= capability_number(capability))
        pick = (select(T.id).where(
            T.status == QUEUED, T.arch == device.arch, gpu,
            or_(T.device_fingerprint.is_(None), T.device_fingerprint == device.fingerprint),
            or_(T.deadline.is_(None), T.deadline > now))
            .order_by(T.priority.desc(), T.created_at, T.id).limit(max_tasks))
        if s.get_bind().dialect.name == "postgresql":
            pick = pick.with_for_update(skip_locked=True)
        claimed = s.execute(
            update(T).where(T.id.in_(pick.scalar_subquery()), T.status == QUEUED)
            .values(status=CLAIMED, device_id=device.id, attempts=T.attempts + 1, claimed_at=now,
                    lease_expires_at=now + timedelta(seconds=lease_s))
            .returning(T.id).execution_options(synchronize_session=False)).scalars().all()
        device.last_heartbeat_at = now
        if claimed:
            device.status = p.DeviceState.busy.value
        tasks = list(s.scalars(select(T).where(T.id.in_(claimed))
                               .order_by(T.priority.desc(), T.created_at, T.id)))
    return tasks


def release(db: Database, agent_id: str, body: p.ReleaseRequest) -> list[str]:
    now = utcnow()
    with db.write() as s:
        device = _device_of(s, agent_id, body.device_id)
        held = s.scalars(select(MeasurementTask).where(
            MeasurementTask.id.in_(body.task_ids), MeasurementTask.device_id == device.id,
            MeasurementTask.status == CLAIMED))
        return [_requeue(t, f"released: {body.reason or 'no reason given'}", now) for t in held]


def task_for_download(db: Database, agent_id: str, task_id: str) -> MeasurementTask:
    """A task claimed by one of the agent's devices (404 otherwise: nothing else is served)."""
    with db.read() as s:
        row = s.execute(select(MeasurementTask).join(Device, MeasurementTask.device_id == Device.id)
                        .where(MeasurementTask.id == task_id, Device.agent_id == agent_id,
                               MeasurementTask.status == CLAIMED)).scalars().first()
    if row is None:
        raise AgentError(f"no task {task_id!r} claimed by this agent's devices", 404)
    return row


def entries_of(task: MeasurementTask, body: p.ResultUpload) -> list[NewEntry]:
    """The profile entries a successful result gives; AgentError (422) when it does not fit."""
    kernels: dict[str, Any] = task.kernels or {}
    got = {k.block: k for k in body.kernels}
    if len(got) != len(body.kernels):
        raise AgentError("a block appears twice in the result")
    unknown = sorted(set(got) - set(kernels))
    missing = sorted(set(kernels) - set(got))
    if unknown or missing:
        raise AgentError(f"the result's kernels do not match the task's: unknown blocks "
                         f"{unknown[:5]}, missing blocks {missing[:5]}")
    entries = []
    for block, info in kernels.items():
        k = got[block]
        samples = list(k.run_samples_s) if k.run_samples_s else list(k.samples_s)
        try:
            summary = summarize(samples)
        except ProfileError as exc:
            raise AgentError(f"kernel {k.symbol}: {exc}") from None
        entries.append(NewEntry(info["signature"], info.get("schedule", "{}"), summary,
                                toolchain=task.toolchain, description=info.get("description")))
    return entries


def submit_result(db: Database, agent_id: str, body: p.ResultUpload,
                  on_finished: TaskFinished | None = None) -> int:
    """Store a result of a task the device holds; the number of profile entries written.

    `on_finished(session, task, device, body)` runs in the same transaction once the task is
    done or failed (a profile job's run ends with its task: service.profiles.runs)."""
    now = utcnow()
    with db.write() as s:
        device = _device_of(s, agent_id, body.device_id)
        task = s.get(MeasurementTask, body.task_id)
        if task is None or task.status != CLAIMED or task.device_id != device.id:
            raise AgentError(f"task {body.task_id!r} is not claimed by device {device.id}", 409)
        written = 0
        if body.status == "failed":
            task.status, task.error = FAILED, body.error
        else:
            entries = entries_of(task, body)
            key = device_class(device.fingerprint, device.facts or {}, body.target or "host")
            written = upsert_entries(s, key, entries)
            task.status, task.error, task.entries = DONE, None, written
        task.finished_at, task.lease_expires_at = now, None
        device.last_heartbeat_at = now
        if on_finished is not None:
            on_finished(s, task, device, body)
        return written


# --- creating tasks (workers, bench) -----------------------------------------------------------

def create_task(db: Database, *, artifact_path: str, artifact_sha256: str, arch: str,
                kernels: dict[str, dict[str, Any]], device_fingerprint: str | None = None,
                gpu_arch: str = "", toolchain: str = "", runs: int = 10, warmup: int = 2,
                repeats: int = 1, threads: int | None = None, timeout_s: float = 600.0,
                priority: int = 0, deadline: datetime | None = None, max_attempts: int = 3) -> str:
    if not kernels:
        raise AgentError("a measurement task needs at least one kernel")
    first = next(iter(kernels.values()))
    with db.write() as s:
        task = MeasurementTask(
            artifact_path=artifact_path, artifact_sha256=artifact_sha256, arch=arch,
            gpu_capability=gpu_arch_number(gpu_arch), device_fingerprint=device_fingerprint,
            signature=first["signature"],
            schedule=first.get("schedule", "{}"), kernels=kernels, toolchain=toolchain[:200],
            runs=runs, warmup=warmup, repeats=repeats, threads=threads, timeout_s=timeout_s,
            priority=priority, deadline=deadline, max_attempts=max_attempts, status=QUEUED,
            attempts=0, entries=0)
        s.add(task)
        s.flush()
        return task.id


def task_status(db: Database, task_ids: Sequence[str]) -> dict[str, str]:
    with db.read() as s:
        return dict(s.execute(select(MeasurementTask.id, MeasurementTask.status)
                              .where(MeasurementTask.id.in_(list(task_ids)))).all())


def task_error(db: Database, task_id: str) -> str | None:
    with db.read() as s:
        return s.scalar(select(MeasurementTask.error).where(MeasurementTask.id == task_id))


def online_devices_for(db: Database, arch: str, gpu_arch: str = "") -> list[Device]:
    """Online devices of `arch` that run kernels built for `gpu_arch` (any, without one)."""
    return [d for d in online_devices(db, arch=arch)
            if gpu_mismatch(gpu_arch, d.facts or {}, d.name) is None]


def online_devices(db: Database, arch: str | None = None,
                   fingerprint: str | None = None) -> list[Device]:
    with db.read() as s:
        query = select(Device).where(Device.status != p.DeviceState.offline.value)
        if arch is not None:
            query = query.where(Device.arch == arch)
        if fingerprint is not None:
            query = query.where(Device.fingerprint == fingerprint)
        return list(s.scalars(query.order_by(Device.last_heartbeat_at.desc())))


# --- workers' own CPUs (profile jobs of host-target artifacts) ---------------------------------

WORKERS_AGENT = "kiln-workers"


def register_worker_device(db: Database, name: str, facts) -> Device:
    """The worker's CPU as a device (transport `worker`) of the built-in agent `kiln-workers`,
    whose token nobody holds; online now. `facts` is a device_agents.facts.HardwareFacts."""
    now = utcnow()
    with db.write() as s:
        agent = s.scalars(select(Agent).where(Agent.name == WORKERS_AGENT)).first()
        if agent is None:
            agent = Agent(name=WORKERS_AGENT, token_prefix=secrets.token_hex(6),
                          token_hash=hash_token(secrets.token_urlsafe(32)), version="worker")
            s.add(agent)
            s.flush()
        device = s.scalars(select(Device).where(Device.agent_id == agent.id,
                                                Device.name == name)).first()
        if device is None:
            device = Device(agent_id=agent.id, name=name, transport="worker", address="")
            s.add(device)
        device.kind, device.arch, device.fingerprint = facts.kind, facts.arch, facts.fingerprint
        device.facts, device.emulated = facts.model_dump(mode="json"), facts.emulated
        device.status, device.error, device.last_heartbeat_at = p.DeviceState.online.value, None, now
        agent.last_seen_at = now
        s.flush()
        return device
