"""Alembic migrations of the service database (from an empty database to head)."""
