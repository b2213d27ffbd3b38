"""The limits' bookkeeping. Each check is one short write transaction, exact across API processes:
the bucket is updated by one conditional UPDATE, and the counting caps lock the tenant's row."""
from __future__ import annotations

import math
import time
from datetime import timedelta

from sqlalchemy import case, delete, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.db import Database, utcnow
from service.limits.tables import EventStream, RateBucket
from service.problems import APIError
from service.tenants.tables import Tenant

STREAM_LEASE_SECONDS = 60.0


def take_token(db: Database, tenant_id: str, rate: float, burst: int) -> float:
    """Take one request's token from the tenant's bucket: 0 when there was one, otherwise the
    seconds until there is."""
    now = time.time()
    elapsed = case((RateBucket.updated_at < now, now - RateBucket.updated_at), else_=0.0)
    level = RateBucket.tokens + elapsed * rate
    level = case((level > burst, float(burst)), else_=level)
    # Concurrent requests read the clock before their UPDATEs queue up, so one may arrive with an
    # earlier `now` than the bucket's: the bucket's time never goes back, or the interval between
    # the two would be refilled twice (more than the burst passing at once across processes).
    latest = case((RateBucket.updated_at < now, now), else_=RateBucket.updated_at)
    try:
        with db.write() as s:
            taken = s.execute(update(RateBucket).where(RateBucket.tenant_id == tenant_id,
                                                       level >= 1.0)
                              .values(tokens=level - 1.0, updated_at=latest)
                              .execution_options(synchronize_session=False)).rowcount
            if taken:
                return 0.0
            bucket = s.get(RateBucket, tenant_id)
            if bucket is None:
                s.add(RateBucket(tenant_id=tenant_id, tokens=burst - 1.0, updated_at=now))
                return 0.0
            have = min(float(burst), bucket.tokens + max(0.0, now - bucket.updated_at) * rate)
            if have < 1.0:
                return (1.0 - have) / rate
    except IntegrityError:  # another process made the bucket at the same moment
        pass
    # Another process made (or changed) the bucket between the UPDATE and the read: PostgreSQL
    # reads each statement's own snapshot, so the read may show a token that the UPDATE did not
    # take. Take it through the UPDATE again instead of letting the request through for free.
    return take_token(db, tenant_id, rate, burst)


def too_many_requests(rate: float, burst: int, wait: float) -> APIError:
    return APIError(429, "Too Many Requests", f"more than {rate:g} requests per second (bursts of "
                    f"{burst}) for your tenant; retry in {wait:.1f} s (KILN_RATE_LIMIT_PER_SECOND)",
                    headers={"Retry-After": str(max(1, math.ceil(wait)))})


def lock_tenant(s: Session, tenant_id: str) -> None:
    """Serialize the tenant's counted writes until the transaction ends (PostgreSQL; SQLite's
    write transactions are serialized already)."""
    s.execute(select(Tenant.id).where(Tenant.id == tenant_id).with_for_update())


def open_stream(db: Database, tenant_id: str, cap: int) -> str:
    """Count a new event stream of the tenant; 429 when `cap` are open (0: no cap)."""
    now = utcnow()
    with db.write() as s:
        lock_tenant(s, tenant_id)
        s.execute(delete(EventStream).where(EventStream.tenant_id == tenant_id,
                                            EventStream.expires_at < now))
        if cap:
            open_now = s.scalar(select(func.count()).select_from(EventStream)
                                .where(EventStream.tenant_id == tenant_id))
            if open_now >= cap:
                raise APIError(429, "Too Many Requests", f"your tenant has {open_now} open event "
                               f"streams, the most allowed (KILN_MAX_EVENT_STREAMS); close one or "
                               "poll the job instead", headers={"Retry-After": "5"})
        stream = EventStream(tenant_id=tenant_id,
                             expires_at=now + timedelta(seconds=STREAM_LEASE_SECONDS))
        s.add(stream)
    return stream.id


def renew_stream(db: Database, stream_id: str) -> None:
    with db.write() as s:
        s.execute(update(EventStream).where(EventStream.id == stream_id).values(
            expires_at=utcnow() + timedelta(seconds=STREAM_LEASE_SECONDS)))


def close_stream(db: Database, stream_id: str) -> None:
    with db.write() as s:
        s.execute(delete(EventStream).where(EventStream.id == stream_id))


def check_stored_bytes(db: Database, tenant_id: str, adding: int, quota: int) -> None:
    """413 when `adding` bytes would take the tenant's models and artifacts past `quota`."""
    from service.jobs.tables import Artifact
    from service.models.tables import ModelRecord

    if not quota:
        return
    with db.read() as s:
        used = (s.scalar(select(func.coalesce(func.sum(ModelRecord.size_bytes), 0))
                         .where(ModelRecord.tenant_id == tenant_id))
                + s.scalar(select(func.coalesce(func.sum(Artifact.size_bytes), 0))
                           .where(Artifact.tenant_id == tenant_id)))
    if used + adding > quota:
        raise APIError(413, "Content Too Large", f"your tenant has {used} bytes stored; this "
                       f"{adding}-byte model would take it past its quota of {quota} bytes "
                       "(KILN_MAX_STORED_BYTES)")
