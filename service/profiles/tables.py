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

from sqlalchemy import Float, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from service.db import Base, UTCDateTime, utcnow

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
