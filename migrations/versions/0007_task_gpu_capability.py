"""measurement tasks: the GPU compute capability a CUDA artifact needs (gpu_capability)

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-24 19:30:00

major * 100 + minor of the architecture a task's CUDA kernels are built for (800 for sm_80);
NULL for an artifact without GPU kernels. A device claims a task only when its GPU's capability
is at least this (device_agents.matching). Additive: plain ADD/DROP COLUMN (see 0003).
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
import service.db  # noqa: F401  (the template's import, kept for uniformity)


revision: str = '0007'
down_revision: str | None = '0006'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column('measurement_tasks', sa.Column('gpu_capability', sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column('measurement_tasks', 'gpu_capability')
