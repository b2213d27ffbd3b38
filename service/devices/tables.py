"""Device agents, the devices they manage, and the measurement tasks those devices run.

An agent authenticates with a per-agent token (`kagent_<prefix>_<secret>`; only the prefix and the
SHA-256 are stored). A device is keyed by (agent, name); `fingerprint` is the facts' fingerprint
(device_agents.facts), which groups identical hardware: profile entries are filed under it.

A measurement task is one kernel bundle (a probe artifact of one or more kernels, in storage) to
measure on a device of `arch` — of the device class `device_fingerprint` when set. `kernels` maps
each of the artifact's blocks to the (signature, schedule) its latency is filed under. Life:
queued → claimed (device_id, lease_expires_at) → done | failed; a lease that expires, a release,
or its device going offline returns it to queued (attempts counts claims; after max_attempts it
fails); a task still queued at its `deadline` expires. A task of a CUDA artifact goes only to a
device whose GPU runs it: `gpu_capability` is the artifact's (major * 100 + minor,
device_agents.matching), at most the device's.
"""
from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, Float, ForeignKey, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from service.db import Base, UTCDateTime, new_id, utcnow


class Agent(Base):
    __tablename__ = "agents"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    token_prefix: Mapped[str] = mapped_column(String(16), unique=True)
    token_hash: Mapped[str] = mapped_column(String(64))
    version: Mapped[str] = mapped_column(String(64), default="")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    last_seen_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class Device(Base):
    __tablename__ = "devices"
    __table_args__ = (
        UniqueConstraint("agent_id", "name"),
        Index("ix_devices_status_heartbeat", "status", "last_heartbeat_at"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    agent_id: Mapped[str] = mapped_column(ForeignKey("agents.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(64))
    transport: Mapped[str] = mapped_column(String(16))  # local, ssh, adb
    address: Mapped[str] = mapped_column(String(256), default="")
    kind: Mapped[str] = mapped_column(String(16))  # cpu, phone, gpu-host
    arch: Mapped[str] = mapped_column(String(32))
    fingerprint: Mapped[str] = mapped_column(String(64), index=True)
    facts: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    emulated: Mapped[bool] = mapped_column(default=False)
    status: Mapped[str] = mapped_column(String(16), default="online")  # online, busy, offline
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    registered_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    last_heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class MeasurementTask(Base):
    __tablename__ = "measurement_tasks"
    __table_args__ = (
        Index("ix_measurement_tasks_queue", "status", "arch", "priority", "created_at"),
        Index("ix_measurement_tasks_lease", "status", "lease_expires_at"),
        Index("ix_measurement_tasks_device", "device_id", "status"),
        Index("ix_measurement_tasks_signature", "signature", "device_fingerprint", "status"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    artifact_path: Mapped[str] = mapped_column(String(500))  # relative to the storage root
    artifact_sha256: Mapped[str] = mapped_column(String(64))
    arch: Mapped[str] = mapped_column(String(32))
    gpu_capability: Mapped[int | None] = mapped_column(Integer, nullable=True)  # CUDA: 800 = sm_80
    device_fingerprint: Mapped[str | None] = mapped_column(String(64), nullable=True)
    signature: Mapped[str | None] = mapped_column(String(64), nullable=True)  # the first kernel's
    schedule: Mapped[str] = mapped_column(String(1000), default="{}")
    kernels: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)  # block -> signature, schedule
    toolchain: Mapped[str] = mapped_column(String(200), default="")
    runs: Mapped[int] = mapped_column(Integer, default=10)
    warmup: Mapped[int] = mapped_column(Integer, default=2)
    repeats: Mapped[int] = mapped_column(Integer, default=1)
    threads: Mapped[int | None] = mapped_column(Integer, nullable=True)
    timeout_s: Mapped[float] = mapped_column(Float, default=600.0)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    status: Mapped[str] = mapped_column(String(16), default="queued")
    device_id: Mapped[str | None] = mapped_column(
        ForeignKey("devices.id", ondelete="SET NULL"), nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    max_attempts: Mapped[int] = mapped_column(Integer, default=3)
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    deadline: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    entries: Mapped[int] = mapped_column(Integer, default=0)  # profile entries its result wrote
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    claimed_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
