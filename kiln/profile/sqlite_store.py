"""The profiling database: measured kernel latencies in SQLite, keyed by device and kernel signature.

One row of `profile_entries` per (device fingerprint, kernel signature, schedule); its median, p10
and p90 summarise the raw samples kept in `profile_samples`. Recording the same (device, kernel,
schedule) again adds samples to the same row and recomputes its statistics from all stored samples
(the most recent MAX_SAMPLES per source are kept). Measured samples outrank predicted ones: an
entry's statistics and source come from its measured samples when it has any, otherwise from its
predicted samples — the two are never mixed.

The yellow-case lookup (`latency`) reads the best entry for (device, signature) — measured entries
before predicted ones, then the lowest median — through the (device_fingerprint, signature,
median_s) index; on a miss it asks the fallback (a RooflineModel by default). Several processes may
share one file: WAL mode, a busy timeout, and every write in one `BEGIN IMMEDIATE` transaction.
The block's canonical description (`describe_block`) and the device's facts are stored too, so
the database can be read without the models or machines it came from.
"""
from __future__ import annotations

import hashlib
import json
import math
import numbers
import os
import sqlite3
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from kiln.ecg import Graph
from kiln.profile import MEASURED, PREDICTED, Estimate, ProfileStore
from kiln.profile.machine import MachineFacts
from kiln.profile.roofline import RooflineModel
from kiln.signature import canonical_json, describe_block

MAX_SAMPLES = 10_000  # per record call, and kept per entry and source
MAX_SECONDS = 3600.0
SCHEMA_VERSION = 1
BUSY_TIMEOUT_S = 60.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS profile_entries (
    id INTEGER PRIMARY KEY,
    device_fingerprint TEXT NOT NULL,
    signature TEXT NOT NULL,
    schedule TEXT NOT NULL DEFAULT '{}',
    median_s REAL NOT NULL,
    p10_s REAL NOT NULL,
    p90_s REAL NOT NULL,
    n INTEGER NOT NULL,
    source TEXT NOT NULL,
    toolchain TEXT NOT NULL DEFAULT '',
    created TEXT NOT NULL,
    UNIQUE (device_fingerprint, signature, schedule)
);
CREATE INDEX IF NOT EXISTS profile_entries_lookup
    ON profile_entries (device_fingerprint, signature);
CREATE INDEX IF NOT EXISTS profile_entries_best
    ON profile_entries (device_fingerprint, signature, median_s);
CREATE TABLE IF NOT EXISTS profile_samples (
    id INTEGER PRIMARY KEY,
    entry_id INTEGER NOT NULL REFERENCES profile_entries (id) ON DELETE CASCADE,
    source TEXT NOT NULL,
    seconds REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS profile_samples_entry ON profile_samples (entry_id, source);
CREATE TABLE IF NOT EXISTS profile_blocks (
    signature TEXT PRIMARY KEY,
    description TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS profile_devices (
    fingerprint TEXT PRIMARY KEY,
    facts TEXT NOT NULL
);
"""


def validate_samples(seconds: float | Sequence[float]) -> list[float]:
    """Latency samples as floats; ValueError naming the first problem."""
    if isinstance(seconds, (str, bytes)):
        raise ValueError("latency samples must be numbers, not a string")
    if isinstance(seconds, numbers.Real):
        values = [seconds]
    elif isinstance(seconds, np.ndarray):
        values = seconds.reshape(-1).tolist()
    else:
        try:
            values = list(seconds)
        except TypeError:
            raise ValueError(f"latency samples must be a number or a sequence of numbers, "
                             f"not {type(seconds).__name__}") from None
    if not values:
        raise ValueError("no latency samples given")
    if len(values) > MAX_SAMPLES:
        raise ValueError(f"too many latency samples: {len(values)} (at most {MAX_SAMPLES} per record)")
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise ValueError(f"latency sample #{i} is not a number: {v!r}")
        f = float(v)
        if math.isnan(f):
            raise ValueError(f"latency sample #{i} is NaN")
        if math.isinf(f):
            raise ValueError(f"latency sample #{i} is infinite")
        if f <= 0:
            raise ValueError(f"latency sample #{i} is {f!r}: latencies must be > 0 seconds")
        if f >= MAX_SECONDS:
            raise ValueError(f"latency sample #{i} is {f!r} s: latencies must be < {MAX_SECONDS:g} s")
        out.append(f)
    return out


def _schedule_text(schedule: dict[str, Any] | None) -> str:
    if schedule is None:
        return "{}"
    if not isinstance(schedule, dict):
        raise ValueError(f"schedule must be a dict, not {type(schedule).__name__}")
    try:
        return canonical_json(schedule)
    except (TypeError, ValueError) as e:
        raise ValueError(f"schedule is not JSON-able: {e}") from None


class SQLiteProfileStore:
    """ProfileStore backed by one SQLite file (or ":memory:") for the kernels of one machine."""

    def __init__(self, path: str | Path, machine: MachineFacts,
                 fallback: ProfileStore | None = None):
        self.path = str(path)
        if self.path != ":memory:" and not Path(self.path).expanduser().parent.is_dir():
            raise FileNotFoundError(f"profile database folder {Path(self.path).parent} does not exist")
        self.machine = machine
        self.fingerprint = machine.fingerprint
        self.fallback: ProfileStore = fallback if fallback is not None else RooflineModel(machine)
        self.hits = 0
        self.misses = 0
        self._lock = threading.RLock()
        self._conn: sqlite3.Connection | None = None
        self._pid = -1
        self._connection()

    # --- connection -----------------------------------------------------------------------
    def _connection(self) -> sqlite3.Connection:
        """The open connection; reopened in a forked child (connections must not cross a fork)."""
        if self._conn is not None and self._pid == os.getpid():
            return self._conn
        if self._conn is not None and self.path == ":memory:":
            return self._conn  # an in-memory database cannot be reopened; it is this process's copy
        conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None,
                               check_same_thread=False)
        conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
        if self.path != ":memory:":
            _enable_wal(conn)
            conn.execute("PRAGMA synchronous = NORMAL")
        conn.execute("PRAGMA foreign_keys = ON")
        self._conn, self._pid = conn, os.getpid()
        with self._write() as c:
            version = c.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise RuntimeError(f"profile database {self.path} has schema version {version}; "
                                   f"this Kiln knows up to {SCHEMA_VERSION}")
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    c.execute(statement)
            c.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            c.execute("INSERT OR IGNORE INTO profile_devices (fingerprint, facts) VALUES (?, ?)",
                      (self.fingerprint, json.dumps(self.machine.to_dict(), sort_keys=True)))
        return conn

    def _write(self):
        return _Transaction(self)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __enter__(self) -> "SQLiteProfileStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- ProfileStore ---------------------------------------------------------------------
    def latency(self, graph: Graph, op_ids: Sequence[str]) -> Estimate:
        signature = _signature(graph, op_ids)[0]
        with self._lock:
            row = self._connection().execute(
                "SELECT median_s, source, p10_s, p90_s FROM profile_entries"
                " WHERE device_fingerprint = ? AND signature = ?"
                " ORDER BY source != ?, median_s, id LIMIT 1",
                (self.fingerprint, signature, MEASURED)).fetchone()
            if row is not None:
                self.hits += 1
                return Estimate(float(row[0]), row[1], float(row[2]), float(row[3]))
            self.misses += 1
        return self.fallback.latency(graph, op_ids)

    def record(self, graph: Graph, op_ids: Sequence[str], seconds: float | Sequence[float],
               source: str = MEASURED, schedule: dict[str, Any] | None = None,
               toolchain: str = "") -> None:
        """Add latency samples of the fused kernel of `op_ids` (run with `schedule`)."""
        if source not in (MEASURED, PREDICTED):
            raise ValueError(f"source must be {MEASURED!r} or {PREDICTED!r}, not {source!r}")
        samples = validate_samples(seconds)
        schedule_text = _schedule_text(schedule)
        if not isinstance(toolchain, str):
            raise ValueError("toolchain must be a string")
        signature, description = _signature(graph, op_ids)
        now = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
        with self._write() as c:
            c.execute("INSERT OR IGNORE INTO profile_blocks (signature, description) VALUES (?, ?)",
                      (signature, description))
            row = c.execute("SELECT id FROM profile_entries WHERE device_fingerprint = ?"
                            " AND signature = ? AND schedule = ?",
                            (self.fingerprint, signature, schedule_text)).fetchone()
            if row is None:
                entry = c.execute(
                    "INSERT INTO profile_entries (device_fingerprint, signature, schedule, median_s,"
                    " p10_s, p90_s, n, source, toolchain, created)"
                    " VALUES (?, ?, ?, 0, 0, 0, 0, ?, ?, ?)",
                    (self.fingerprint, signature, schedule_text, source, toolchain, now)).lastrowid
            else:
                entry = row[0]
            c.executemany("INSERT INTO profile_samples (entry_id, source, seconds) VALUES (?, ?, ?)",
                          [(entry, source, s) for s in samples])
            # Keep the most recent MAX_SAMPLES samples of this source.
            c.execute("DELETE FROM profile_samples WHERE entry_id = ? AND source = ? AND id NOT IN"
                      " (SELECT id FROM profile_samples WHERE entry_id = ? AND source = ?"
                      "  ORDER BY id DESC LIMIT ?)", (entry, source, entry, source, MAX_SAMPLES))
            best = MEASURED if c.execute(
                "SELECT 1 FROM profile_samples WHERE entry_id = ? AND source = ? LIMIT 1",
                (entry, MEASURED)).fetchone() else PREDICTED
            kept = np.array([r[0] for r in c.execute(
                "SELECT seconds FROM profile_samples WHERE entry_id = ? AND source = ?",
                (entry, best))], dtype=np.float64)
            p10, median, p90 = np.percentile(kept, [10, 50, 90])
            c.execute("UPDATE profile_entries SET median_s = ?, p10_s = ?, p90_s = ?, n = ?,"
                      " source = ?, toolchain = CASE WHEN ? != '' THEN ? ELSE toolchain END"
                      " WHERE id = ?",
                      (float(median), float(p10), float(p90), int(kept.size), best,
                       toolchain, toolchain, entry))

    # --- queries --------------------------------------------------------------------------
    def schedules(self, graph: Graph, op_ids: Sequence[str]) -> list[tuple[dict[str, Any], float]]:
        """Every schedule recorded for this block on this machine with its median, best first."""
        signature = _signature(graph, op_ids)[0]
        with self._lock:
            rows = self._connection().execute(
                "SELECT schedule, median_s FROM profile_entries"
                " WHERE device_fingerprint = ? AND signature = ? ORDER BY median_s, id",
                (self.fingerprint, signature)).fetchall()
        return [(json.loads(s), float(m)) for s, m in rows]

    def entry(self, graph: Graph, op_ids: Sequence[str],
              schedule: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """The stored row for this block and schedule on this machine, as a dict, or None."""
        signature = _signature(graph, op_ids)[0]
        with self._lock:
            cur = self._connection().execute(
                "SELECT * FROM profile_entries WHERE device_fingerprint = ? AND signature = ?"
                " AND schedule = ?", (self.fingerprint, signature, _schedule_text(schedule)))
            row = cur.fetchone()
            names = [d[0] for d in cur.description]
        return None if row is None else dict(zip(names, row))

    def __len__(self) -> int:
        """Number of entries (kernel × schedule) recorded for this store's machine."""
        with self._lock:
            return self._connection().execute(
                "SELECT COUNT(*) FROM profile_entries WHERE device_fingerprint = ?",
                (self.fingerprint,)).fetchone()[0]

    def __repr__(self) -> str:
        return f"SQLiteProfileStore({self.path!r}, device={self.fingerprint})"


class _Transaction:
    """`with store._write() as conn:` runs the body in BEGIN IMMEDIATE … COMMIT (ROLLBACK on error)."""

    def __init__(self, store: SQLiteProfileStore):
        self.store = store

    def __enter__(self) -> sqlite3.Connection:
        self.store._lock.acquire()
        try:
            conn = self.store._connection()
            _begin_immediate(conn)
        except BaseException:
            self.store._lock.release()
            raise
        self.conn = conn
        return conn

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.conn.execute("ROLLBACK" if exc_type else "COMMIT")
        finally:
            self.store._lock.release()


def _begin_immediate(conn: sqlite3.Connection) -> None:
    # busy_timeout covers most contention; retry briefly for the rare SQLITE_BUSY it does not.
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    while True:
        try:
            conn.execute("BEGIN IMMEDIATE")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) and "busy" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _signature(graph: Graph, op_ids: Sequence[str]) -> tuple[str, str]:
    """(kernel_signature, the canonical JSON it hashes) in one pass."""
    description = canonical_json(describe_block(graph, op_ids))
    return hashlib.sha256(description.encode("ascii")).hexdigest(), description


def _enable_wal(conn: sqlite3.Connection) -> None:
    """Switch to WAL, retrying: while another process initialises the file SQLite can answer
    "locked" to a journal-mode change at once, without waiting in its busy handler."""
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    while True:
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)
