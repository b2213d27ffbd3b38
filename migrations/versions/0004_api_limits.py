"""jobs: Idempotency-Key; per-tenant request buckets and open event streams

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-24 14:40:00

Additive only. `jobs.idempotency_key` is unique per tenant through a unique index (NULLs, the
jobs without a key, never collide on SQLite or PostgreSQL); plain ADD COLUMN and CREATE INDEX, no
batch rebuild of `jobs` (see 0003).
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
import service.db


revision: str = '0004'
down_revision: str | None = '0003'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column('jobs', sa.Column('idempotency_key', sa.String(length=200), nullable=True))
    op.add_column('jobs', sa.Column('request_sha256', sa.String(length=64), nullable=True))
    op.create_index('ix_jobs_tenant_idempotency', 'jobs', ['tenant_id', 'idempotency_key'],
                    unique=True)
    op.create_table(
        'rate_buckets',
        sa.Column('tenant_id', sa.String(length=32), nullable=False),
        sa.Column('tokens', sa.Float(), nullable=False),
        sa.Column('updated_at', sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], ondelete='CASCADE',
                                name=op.f('fk_rate_buckets_tenant_id_tenants')),
        sa.PrimaryKeyConstraint('tenant_id', name=op.f('pk_rate_buckets')),
    )
    op.create_table(
        'event_streams',
        sa.Column('id', sa.String(length=32), nullable=False),
        sa.Column('tenant_id', sa.String(length=32), nullable=False),
        sa.Column('expires_at', service.db.UTCDateTime(), nullable=False),
        sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], ondelete='CASCADE',
                                name=op.f('fk_event_streams_tenant_id_tenants')),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_event_streams')),
    )
    op.create_index('ix_event_streams_tenant_expires', 'event_streams',
                    ['tenant_id', 'expires_at'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_event_streams_tenant_expires', table_name='event_streams')
    op.drop_table('event_streams')
    op.drop_table('rate_buckets')
    op.drop_index('ix_jobs_tenant_idempotency', table_name='jobs')
    op.drop_column('jobs', 'request_sha256')
    op.drop_column('jobs', 'idempotency_key')
