from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, Boolean, Float, ForeignKey, Index, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from service.db import Base, UTCDateTime, new_id, utcnow

QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED = "queued", "running", "succeeded", "failed", "cancelled"
STATES = (QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED)
TERMINAL = (SUCCEEDED, FAILED, CANCELLED)


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        Index("ix_jobs_tenant_created", "tenant_id", "created_at"),
        Index("ix_jobs_state_heartbeat", "state", "heartbeat_at"),
        Index("ix_jobs_state_enqueued", "state", "enqueued_at"),
        Index("ix_jobs_tenant_idempotency", "tenant_id", "idempotency_key", unique=True),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    model_id: Mapped[str] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"), index=True)
    target: Mapped[str] = mapped_column(String(32))
    partitioner: Mapped[str] = mapped_column(String(64))
    shapes: Mapped[dict[str, list[int]]] = mapped_column(JSON, default=dict)
    rewrite: Mapped[bool] = mapped_column(Boolean, default=True)
    # Schedule tuning (kiln.tune.TUNE_MODES); seconds, None for the mode's default.
    # The server default gives rows from before migration 0003 "off".
    tune: Mapped[str] = mapped_column(String(16), default="off", server_default="off")
    tune_budget_s: Mapped[float | None] = mapped_column(Float, nullable=True)

    # The client's Idempotency-Key (unique per tenant) and the SHA-256 of the request it came
    # with: a retry with the same key gets this job, with another request a 422.
    idempotency_key: Mapped[str | None] = mapped_column(String(200), nullable=True)
    request_sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)

    state: Mapped[str] = mapped_column(String(16), default=QUEUED)
    stage: Mapped[str | None] = mapped_column(String(32), nullable=True)
    progress: Mapped[int] = mapped_column(Integer, default=0)
    stage_seconds: Mapped[dict[str, float]] = mapped_column(JSON, default=dict)
    # Within the stage: what the compiler is doing ("measuring kernel 12/38"); None when the
    # stage reported nothing (migration 0006).
    step_done: Mapped[int | None] = mapped_column(Integer, nullable=True)
    step_total: Mapped[int | None] = mapped_column(Integer, nullable=True)
    step_text: Mapped[str | None] = mapped_column(String(200), nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    report: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)

    # The worker side: each claim increments `attempts`, which fences every later write.
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    worker: Mapped[str | None] = mapped_column(String(200), nullable=True)
    heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)

    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    enqueued_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class Artifact(Base):
    """The one artifact of a succeeded job, at `path` under the storage root."""

    __tablename__ = "artifacts"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), unique=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    path: Mapped[str] = mapped_column(String(500))
    sha256: Mapped[str] = mapped_column(String(64))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
