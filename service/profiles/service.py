"""Writing and reading profile entries: the two lookups and the upsert of measured summaries.

Entries are keyed by (device fingerprint, kernel signature, schedule). A new measurement of an
existing key replaces it (the latest measurement of a kernel is the one that counts: toolchains
and runners change); a predicted entry never replaces a measured one.
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy import case, select, text
from sqlalchemy.orm import Session

from kiln.profile import Estimate
from service.db import Database, utcnow
from service.profiles.tables import (
    MAX_SCHEDULE_CHARS,
    MEASURED,
    PREDICTED,
    ProfileBlock,
    ProfileEntry,
)

MAX_SECONDS = 3600.0
MAX_SAMPLES = 100_000
MAX_DESCRIPTION_CHARS = 1 << 20
HEX64 = frozenset("0123456789abcdef")


class ProfileError(ValueError):
    """An entry that cannot be stored (the message says what is wrong with it)."""


@dataclass(frozen=True)
class Summary:
    median_s: float
    p10_s: float
    p90_s: float
    n: int


@dataclass(frozen=True)
class NewEntry:
    signature: str
    schedule: str  # canonical JSON (kiln.signature.canonical_json)
    summary: Summary
    source: str = MEASURED
    toolchain: str = ""
    description: str | None = None  # describe_block's canonical JSON


def summarize(samples: Sequence[float]) -> Summary:
    """median / p10 / p90 / n of latency samples; ProfileError for an empty or absurd one."""
    values = list(samples)
    if not values:
        raise ProfileError("no latency samples")
    if len(values) > MAX_SAMPLES:
        raise ProfileError(f"{len(values)} latency samples; at most {MAX_SAMPLES}")
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or not 0 < v < MAX_SECONDS:
            raise ProfileError(f"latency sample #{i} is {v!r}: latencies must be finite, > 0 and "
                               f"< {MAX_SECONDS:g} s")
    p10, median, p90 = np.percentile(np.asarray(values, dtype=np.float64), [10, 50, 90])
    return Summary(float(median), float(p10), float(p90), len(values))


def check_key(fingerprint: str, signature: str, schedule: str) -> None:
    for what, value in (("device fingerprint", fingerprint), ("kernel signature", signature)):
        if not isinstance(value, str) or len(value) != 64 or not set(value) <= HEX64:
            raise ProfileError(f"{what} must be 64 lowercase hex digits, got {value!r:.80}")
    if not isinstance(schedule, str) or len(schedule) > MAX_SCHEDULE_CHARS:
        raise ProfileError(f"schedule must be JSON text of at most {MAX_SCHEDULE_CHARS} characters")
    try:
        parsed = json.loads(schedule)
    except ValueError:
        raise ProfileError(f"schedule is not JSON: {schedule[:80]!r}") from None
    if not isinstance(parsed, dict):
        raise ProfileError("schedule must be a JSON object")


def upsert_entries(session: Session, fingerprint: str, entries: Iterable[NewEntry]) -> int:
    """Insert or replace entries for one device class in the session's transaction; the count."""
    entries = list(entries)
    if not entries:
        return 0
    for e in entries:
        check_key(fingerprint, e.signature, e.schedule)
        if e.source not in (MEASURED, PREDICTED):
            raise ProfileError(f"source must be {MEASURED!r} or {PREDICTED!r}, not {e.source!r}")
        if e.description is not None and len(e.description) > MAX_DESCRIPTION_CHARS:
            raise ProfileError("block description too long")
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    described = {e.signature: e.description for e in entries if e.description}
    if described:
        stmt = insert(ProfileBlock).values(
            [{"signature": k, "description": v} for k, v in sorted(described.items())])
        session.execute(stmt.on_conflict_do_nothing(index_elements=["signature"]))
    now = utcnow()
    latest: dict[tuple[str, str], NewEntry] = {}
    for e in entries:  # the last of duplicates wins, like successive calls
        latest[(e.signature, e.schedule)] = e
    rows = [{"device_fingerprint": fingerprint, "signature": e.signature, "schedule": e.schedule,
             "median_s": e.summary.median_s, "p10_s": e.summary.p10_s, "p90_s": e.summary.p90_s,
             "n": e.summary.n, "source": e.source, "toolchain": e.toolchain[:200],
             "created_at": now} for e in latest.values()]
    for start in range(0, len(rows), 500):
        stmt = insert(ProfileEntry).values(rows[start:start + 500])
        new = stmt.excluded
        keep_measured = (ProfileEntry.source == MEASURED) & (new.source == PREDICTED)
        stmt = stmt.on_conflict_do_update(
            index_elements=["device_fingerprint", "signature", "schedule"],
            set_={c: case((keep_measured, getattr(ProfileEntry, c)), else_=getattr(new, c))
                  for c in ("median_s", "p10_s", "p90_s", "n", "source", "toolchain",
                            "created_at")})
        session.execute(stmt)
    return len(rows)


def record(db: Database, fingerprint: str, entries: Iterable[NewEntry]) -> int:
    with db.write() as s:
        return upsert_entries(s, fingerprint, entries)


# --- the two lookups ---------------------------------------------------------------------------

# The lookups are plain SQL (compiled once by SQLAlchemy): they run for every yellow-case question
# of every compile, and building ORM statements each time costs more than the indexed query.
_BEST = text(
    "SELECT median_s, source, p10_s, p90_s FROM profile_entries"
    " WHERE device_fingerprint = :fingerprint AND signature = :signature"
    " ORDER BY CASE WHEN source = 'measured' THEN 0 ELSE 1 END, median_s LIMIT 1")
_SCHEDULES = text(
    "SELECT schedule, median_s, source FROM profile_entries"
    " WHERE device_fingerprint = :fingerprint AND signature = :signature"
    " ORDER BY median_s, id")


def best(session: Session, fingerprint: str, signature: str) -> Estimate | None:
    """The yellow-case lookup: the best schedule's median, source and p10/p90, measured first
    (served by the unique (device_fingerprint, signature, schedule) index)."""
    row = session.execute(_BEST, {"fingerprint": fingerprint, "signature": signature}).first()
    return None if row is None else Estimate(float(row[0]), row[1], float(row[2]), float(row[3]))


def schedules(session: Session, fingerprint: str, signature: str,
              measured_only: bool = False) -> list[tuple[dict[str, Any], float, str]]:
    """The schedule-tuning lookup: every schedule of the kernel on the device class, best first
    (served by ix_profile_entries_best)."""
    rows = session.execute(_SCHEDULES, {"fingerprint": fingerprint, "signature": signature})
    return [(json.loads(s), float(m), src) for s, m, src in rows
            if not measured_only or src == MEASURED]


def count(db: Database, fingerprint: str | None = None, source: str | None = None) -> int:
    from sqlalchemy import func

    query = select(func.count()).select_from(ProfileEntry)
    if fingerprint is not None:
        query = query.where(ProfileEntry.device_fingerprint == fingerprint)
    if source is not None:
        query = query.where(ProfileEntry.source == source)
    with db.read() as s:
        return int(s.scalar(query))
