from __future__ import annotations

from datetime import datetime

from sqlalchemy import Float, ForeignKey, Index, String
from sqlalchemy.orm import Mapped, mapped_column

from service.db import Base, UTCDateTime, new_id


class RateBucket(Base):
    """A tenant's token bucket: `tokens` as of `updated_at` (seconds since the epoch)."""

    __tablename__ = "rate_buckets"

    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"),
                                           primary_key=True)
    tokens: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)


class EventStream(Base):
    """An open server-sent event stream, leased: its API process renews `expires_at` while it
    streams and deletes the row at the end, so a crashed process's streams lapse by themselves."""

    __tablename__ = "event_streams"
    __table_args__ = (Index("ix_event_streams_tenant_expires", "tenant_id", "expires_at"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime())
