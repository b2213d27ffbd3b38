"""jobs: progress within a stage (step_done, step_total, step_text)

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-24 15:00:00

What a long stage is doing, as the compiler reports it ("measuring kernel 12/38"): all three
NULL when the stage reported nothing. Additive: plain ADD/DROP COLUMN (see 0003 for why not a
batch rebuild on SQLite).
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
import service.db  # noqa: F401  (the template's import, kept for uniformity)


revision: str = '0006'
down_revision: str | None = '0005'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column('jobs', sa.Column('step_done', sa.Integer(), nullable=True))
    op.add_column('jobs', sa.Column('step_total', sa.Integer(), nullable=True))
    op.add_column('jobs', sa.Column('step_text', sa.String(length=200), nullable=True))


def downgrade() -> None:
    op.drop_column('jobs', 'step_text')
    op.drop_column('jobs', 'step_total')
    op.drop_column('jobs', 'step_done')
