"""Database access: the declarative base, one engine per process, read and write sessions.

SQLite (embedded) runs in WAL mode with a busy timeout, and write sessions start with
`BEGIN IMMEDIATE` so that concurrent writers queue instead of failing on a lock upgrade.
PostgreSQL URLs use psycopg 3.
"""
from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from sqlalchemy import DateTime, MetaData, create_engine, event
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker
from sqlalchemy.types import TypeDecorator

SQLITE_BUSY_TIMEOUT_MS = 60_000

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class UTCDateTime(TypeDecorator):
    """Timezone-aware UTC datetimes on every backend (SQLite stores them naive)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect):
        if value is not None and value.tzinfo is None:
            raise ValueError("naive datetime")
        if value is not None and dialect.name == "sqlite":
            return value.astimezone(timezone.utc).replace(tzinfo=None)
        return value

    def process_result_value(self, value: datetime | None, dialect):
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)
        return value


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def new_id() -> str:
    return uuid.uuid4().hex


def load_tables() -> MetaData:
    """Import every domain's tables; return the metadata that holds them."""
    from service.dashboard import tables as _dashboard  # noqa: F401
    from service.devices import tables as _devices  # noqa: F401
    from service.jobs import tables as _jobs  # noqa: F401
    from service.limits import tables as _limits  # noqa: F401
    from service.models import tables as _models  # noqa: F401
    from service.profiles import tables as _profiles  # noqa: F401
    from service.tenants import tables as _tenants  # noqa: F401
    return Base.metadata


def normalize_url(url: str) -> str:
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed.render_as_string(hide_password=False)


def make_engine(url: str) -> Engine:
    url = normalize_url(url)
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20)
    if parsed.database and parsed.database != ":memory:":
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 60})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record):
        dbapi_conn.isolation_level = None  # SQLAlchemy's "begin" event issues BEGIN itself
        cursor = dbapi_conn.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn):
        immediate = conn.get_execution_options().get("kiln_write", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    return engine


class Database:
    """An engine and its sessions. `read()` for queries, `write()` for anything that changes rows."""

    def __init__(self, url: str):
        load_tables()  # every mapper's foreign keys need all tables
        self.url = url
        self.engine = make_engine(url)
        self._read = sessionmaker(self.engine, expire_on_commit=False)
        self._write = sessionmaker(self.engine.execution_options(kiln_write=True),
                                   expire_on_commit=False)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    @contextmanager
    def read(self) -> Iterator[Session]:
        with self._read() as session:  # closing ends the transaction; objects stay loaded
            yield session

    @contextmanager
    def write(self) -> Iterator[Session]:
        """A transaction committed when the block ends without an exception."""
        with self._write() as session, session.begin():
            yield session

    def dispose(self) -> None:
        self.engine.dispose()


_databases: dict[str, Database] = {}


def database(url: str) -> Database:
    """The process's Database for `url` (one engine per URL and process)."""
    db = _databases.get(url)
    if db is None:
        db = _databases[url] = Database(url)
    return db


def _forget_in_child() -> None:
    # A forked process (a Celery pool child) must not share its parent's pooled connections.
    for db in _databases.values():
        db.engine.dispose(close=False)
    _databases.clear()


import os as _os  # noqa: E402

_os.register_at_fork(after_in_child=_forget_in_child)
