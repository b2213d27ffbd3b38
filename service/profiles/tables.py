from __future__ import annotations

from datetime import datetime

from sqlalchemy import Float, ForeignKey, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from service.db import Base, UTCDateTime, utcnow


class ProfileEntry(Base):
    """One (device, kernel signature, schedule): summary of its latency samples.

    Mirrors kiln.profile.sqlite_store's `profile_entries`, keyed by device row instead of
    fingerprint.
    """

    __tablename__ = "profile_entries"
    __table_args__ = (
        UniqueConstraint("device_id", "signature", "schedule"),
        Index("ix_profile_entries_lookup", "device_id", "signature", "median_s"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    device_id: Mapped[str] = mapped_column(ForeignKey("devices.id", ondelete="CASCADE"))
    signature: Mapped[str] = mapped_column(String(64))
    schedule: Mapped[str] = mapped_column(String(500), default="{}")
    block: Mapped[str] = mapped_column(Text, default="")  # describe_block's canonical JSON
    median_s: Mapped[float] = mapped_column(Float)
    p10_s: Mapped[float] = mapped_column(Float)
    p90_s: Mapped[float] = mapped_column(Float)
    n: Mapped[int] = mapped_column(Integer)
    source: Mapped[str] = mapped_column(String(16))  # "measured" or "predicted"
    toolchain: Mapped[str] = mapped_column(String(200), default="")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
