"""The profile store of this machine: one SQLite file shared by every Kiln process of the user."""
from __future__ import annotations

import os
from pathlib import Path

from kiln.files import cache_dir
from kiln.profile.machine import host_machine
from kiln.profile.sqlite_store import SQLiteProfileStore


def default_db_path() -> Path:
    """`$KILN_PROFILE_DB`, else `profiles.sqlite` in `$KILN_CACHE_DIR` (default `~/.cache/kiln`)."""
    env = os.environ.get("KILN_PROFILE_DB")
    return Path(env).expanduser() if env else cache_dir() / "profiles.sqlite"


def default_store(path: str | Path | None = None) -> SQLiteProfileStore:
    """A SQLiteProfileStore for this machine (`host_machine()`) at `path` or the default path."""
    if str(path) == ":memory:":
        return SQLiteProfileStore(":memory:", host_machine())
    db = Path(path).expanduser() if path is not None else default_db_path()
    db.parent.mkdir(parents=True, exist_ok=True)
    return SQLiteProfileStore(db, host_machine())
