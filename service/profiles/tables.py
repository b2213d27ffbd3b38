"""The shared profiling database: kernel latencies per device class, kernel signature and schedule.

One `profile_entries` row per (device fingerprint, kernel signature, schedule) summarises that
kernel's latency samples (median / p10 / p90 over n); `source` says whether it was measured on the
device or predicted. The two lookups of the papers have an index each:

- the yellow-case lookup (DNNFusion §4.3): signature on a device class, the best entry —
  `uq_profile_entries_device_fingerprint` (device_fingerprint, signature, schedule) leads with it;
- the schedule-tuning lookup (FusionStitching §4.4): every schedule of a signature on a device
  class, best first — `ix_profile_entries_best` (device_fingerprint, signature, median_s).

`profile_blocks` keeps each signature's canonical block description (kiln.signature.describe_block)
once, so the database can be read without the models it came from.
"""
from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, Float, ForeignKey, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from service.db import Base, UTCDateTime, new_id, utcnow

MEASURED, PREDICTED = "measured", "predicted"
MAX_SCHEDULE_CHARS = 1000


class ProfileEntry(Base):
    __tablename__ = "profile_entries"
    __table_args__ = (
        UniqueConstraint("device_fingerprint", "signature", "schedule"),
        Index("ix_profile_entries_best", "device_fingerprint", "signature", "median_s"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    device_fingerprint: Mapped[str] = mapped_column(String(64))
    signature: Mapped[str] = mapped_column(String(64))
    schedule: Mapped[str] = mapped_column(String(MAX_SCHEDULE_CHARS), default="{}")  # canonical JSON
    median_s: Mapped[float] = mapped_column(Float)
    p10_s: Mapped[float] = mapped_column(Float)
    p90_s: Mapped[float] = mapped_column(Float)
    n: Mapped[int] = mapped_column(Integer)
    source: Mapped[str] = mapped_column(String(16))  # measured | predicted
    toolchain: Mapped[str] = mapped_column(String(200), default="")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class ProfileBlock(Base):
    __tablename__ = "profile_blocks"

    signature: Mapped[str] = mapped_column(String(64), primary_key=True)
    description: Mapped[str] = mapped_column(Text)


class JobLookup(Base):
    """One profile lookup a compile made (the yellow-case question for a set of ops) and how it
    was answered: `answer` is the store's kind of answer (hit, measured-local, measured-agent,
    cost-model (why), …), `source` the estimate's (measured, predicted, cost-model).

    Jobs link to the signatures they looked up through these rows; the profiles API shows a job's
    rows only to the job's tenant."""

    __tablename__ = "job_lookups"
    __table_args__ = (Index("ix_job_lookups_signature", "signature", "job_id"),
                      Index("ix_job_lookups_created", "created_at"))

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    signature: Mapped[str] = mapped_column(String(64))
    ops: Mapped[list[str]] = mapped_column(JSON, default=list)  # ECG op ids, topological order
    answer: Mapped[str] = mapped_column(String(64))
    source: Mapped[str] = mapped_column(String(16))
    seconds: Mapped[float] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class JobPlan(Base):
    """A succeeded job's fusion plan as a graph (kiln.report.plan_graph), for the plan API."""

    __tablename__ = "job_plans"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    graph: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class ProfileRun(Base):
    """A profile job: a job's whole artifact run on one device (an agent's, or a worker's CPU).

    queued → running → succeeded | failed. `task_id` is the measurement task an agent claims (None
    when a worker runs it); `result` holds per-kernel latency summaries, the end-to-end latency and
    the memory figures (service.profiles.runs)."""

    __tablename__ = "profile_runs"
    __table_args__ = (Index("ix_profile_runs_job", "job_id", "created_at"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    selector: Mapped[str] = mapped_column(String(1000), default="")
    via: Mapped[str] = mapped_column(String(16))  # agent | worker
    state: Mapped[str] = mapped_column(String(16), default="queued")
    task_id: Mapped[str | None] = mapped_column(
        ForeignKey("measurement_tasks.id", ondelete="SET NULL"), nullable=True, unique=True)
    device_id: Mapped[str | None] = mapped_column(
        ForeignKey("devices.id", ondelete="SET NULL"), nullable=True, index=True)
    runs: Mapped[int] = mapped_column(Integer, default=20)
    warmup: Mapped[int] = mapped_column(Integer, default=3)
    repeats: Mapped[int] = mapped_column(Integer, default=3)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
