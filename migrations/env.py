"""Alembic environment: the URL is the Settings' (or one given by service.migrate), online only.

On PostgreSQL the upgrade holds an advisory lock, so API replicas starting together migrate once.
"""
from __future__ import annotations

from alembic import context
from sqlalchemy import text

from service.db import load_tables, make_engine
from service.settings import Settings

MIGRATION_LOCK = 7_405_181  # pg_advisory_lock key

config = context.config
target_metadata = load_tables()


def run_migrations_online() -> None:
    url = config.attributes.get("url") or Settings().database_url
    engine = make_engine(url)
    with engine.connect() as connection:
        postgres = connection.dialect.name == "postgresql"
        if postgres:
            connection.execute(text("SELECT pg_advisory_lock(:k)"), {"k": MIGRATION_LOCK})
            connection.commit()
        try:
            context.configure(connection=connection, target_metadata=target_metadata,
                              render_as_batch=connection.dialect.name == "sqlite",
                              compare_type=True)
            with context.begin_transaction():
                context.run_migrations()
        finally:
            if postgres:
                connection.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": MIGRATION_LOCK})
                connection.commit()
    engine.dispose()


if context.is_offline_mode():
    raise SystemExit("Kiln's migrations run online only (against a database URL)")
run_migrations_online()
