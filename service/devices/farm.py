"""The device farm as users see it: every device with its facts, status and work.

Devices are shared by all tenants (the farm measures everybody's kernels), so nothing here is
tenant-scoped; a device's tasks are shown without the jobs or models they came from.
"""
from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field
from sqlalchemy import func, or_, select

from device_agents import protocol as p
from device_agents.facts import device_targets
from service.db import Database
from service.devices import selector as sel
from service.devices.service import CLAIMED, QUEUED
from service.devices.tables import Agent, Device, MeasurementTask
from service.problems import APIError

MAX_DEVICES = 1000


class TaskOut(BaseModel):
    id: str
    status: str
    kernels: int
    runs: int
    attempts: int
    entries: int
    error: str | None
    created_at: datetime
    finished_at: datetime | None


class DeviceOut(BaseModel):
    id: str
    name: str
    agent: str = Field(description="the agent that registered it (kiln-workers: a worker's CPU)")
    kind: str
    arch: str
    transport: str
    features: list[str] = Field(description="ISA features recorded from the device")
    fingerprint: str = Field(description="the device class its profile entries are filed under")
    targets: list[str] = Field(description="the compile targets whose artifacts it runs "
                               "(`kiln compile --target`): its CPU's, and opencl or "
                               "opencl-aarch64 where it has an OpenCL device")
    facts: dict[str, Any] = Field(description="everything read from the device (cores, caches, "
                                  "memory, GPU model, Android build…)")
    emulated: bool
    status: str = Field(description="online, busy or offline")
    online: bool
    error: str | None = Field(description="why it is offline")
    last_heartbeat_at: datetime | None
    registered_at: datetime
    queued_tasks: int = Field(description="measurement tasks waiting that it could claim")
    running_tasks: int = Field(description="measurement tasks it holds")
    recent_tasks: list[TaskOut] | None = None


def _out(device: Device, agent: str, queued: int, running: int) -> DeviceOut:
    return DeviceOut(
        id=device.id, name=device.name, agent=agent, kind=device.kind, arch=device.arch,
        transport=device.transport, features=list((device.facts or {}).get("isa") or ()),
        fingerprint=device.fingerprint, targets=device_targets(device.facts or {}),
        facts=device.facts or {}, emulated=device.emulated,
        status=device.status, online=device.status != p.DeviceState.offline.value,
        error=device.error, last_heartbeat_at=device.last_heartbeat_at,
        registered_at=device.registered_at, queued_tasks=queued, running_tasks=running)


def list_devices(db: Database, selector: sel.Selector) -> list[DeviceOut]:
    """Devices matching the selector: online first, then by name."""
    with db.read() as s:
        rows = s.execute(select(Device, Agent.name).join(Agent, Agent.id == Device.agent_id)
                         .where(Agent.revoked_at.is_(None))
                         .order_by(Device.name, Device.id).limit(MAX_DEVICES)).all()
        matched = [(d, a) for d, a in rows if selector.matches(d)]
        running = dict(s.execute(
            select(MeasurementTask.device_id, func.count()).where(
                MeasurementTask.status == CLAIMED).group_by(MeasurementTask.device_id)).all())
        waiting = s.execute(select(MeasurementTask.arch, MeasurementTask.device_fingerprint,
                                   func.count()).where(MeasurementTask.status == QUEUED)
                            .group_by(MeasurementTask.arch, MeasurementTask.device_fingerprint)).all()
    out = []
    for device, agent in matched:
        queued = sum(n for arch, fp, n in waiting
                     if arch == device.arch and fp in (None, device.fingerprint))
        out.append(_out(device, agent, queued, running.get(device.id, 0)))
    return sorted(out, key=lambda d: (not d.online, d.name))


def get_device(db: Database, device_id: str, recent: int = 20) -> DeviceOut:
    with db.read() as s:
        row = s.execute(select(Device, Agent.name).join(Agent, Agent.id == Device.agent_id)
                        .where(Device.id == device_id)).first()
        if row is None:
            raise APIError(404, "Not Found", f"no device with id {device_id!r}")
        device, agent = row
        T = MeasurementTask
        tasks = list(s.scalars(select(T).where(T.device_id == device.id)
                               .order_by(T.created_at.desc()).limit(recent)))
        queued = s.scalar(select(func.count()).select_from(T).where(
            T.status == QUEUED, T.arch == device.arch,
            or_(T.device_fingerprint.is_(None), T.device_fingerprint == device.fingerprint)))
        running = s.scalar(select(func.count()).select_from(T).where(
            T.status == CLAIMED, T.device_id == device.id))
    out = _out(device, agent, int(queued), int(running))
    out.recent_tasks = [TaskOut(id=t.id, status=t.status, kernels=len(t.kernels or {}),
                                runs=t.runs, attempts=t.attempts, entries=t.entries, error=t.error,
                                created_at=t.created_at, finished_at=t.finished_at) for t in tasks]
    return out


def devices_by_fingerprint(db: Database) -> dict[str, list[str]]:
    """Device names per device class."""
    with db.read() as s:
        rows = s.execute(select(Device.fingerprint, Device.name).order_by(Device.name)).all()
    names: dict[str, list[str]] = {}
    for fingerprint, name in rows:
        names.setdefault(fingerprint, []).append(name)
    return names


def fingerprints_matching(db: Database, selector: sel.Selector) -> set[str]:
    with db.read() as s:
        devices = list(s.scalars(select(Device)))
    return {d.fingerprint for d in devices if selector.matches(d)}
