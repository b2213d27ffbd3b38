"""jobs: schedule tuning options (tune, tune_budget_s)

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-21 17:30:00

`tune` is NOT NULL with the server default 'off', so jobs created before this revision read as
untuned; `tune_budget_s` is NULL for the mode's default budget. Plain ADD/DROP COLUMN on both
SQLite and PostgreSQL: a batch (copy-and-move) rebuild of `jobs` on SQLite would drop the table
with foreign keys on, and its cascade would delete every artifact row.
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
import service.db  # noqa: F401  (the template's import, kept for uniformity)


revision: str = '0003'
down_revision: str | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column('jobs', sa.Column('tune', sa.String(length=16), nullable=False,
                                    server_default='off'))
    op.add_column('jobs', sa.Column('tune_budget_s', sa.Float(), nullable=True))


def downgrade() -> None:
    op.drop_column('jobs', 'tune_budget_s')
    op.drop_column('jobs', 'tune')
