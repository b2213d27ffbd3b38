"""dashboard: job lookups and plans, profile runs, sign-in sessions

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-24 14:27:23

Additive only: four new tables. `job_lookups` links each job to the kernel signatures its compile
looked up and how each was answered; `job_plans` keeps a job's fusion plan as a graph;
`profile_runs` are profile jobs; `dashboard_sessions` are the dashboard's sign-in sessions.
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
import service.db


revision: str = '0005'
down_revision: str | None = '0004'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('dashboard_sessions',
    sa.Column('token_hash', sa.String(length=64), nullable=False),
    sa.Column('tenant_id', sa.String(length=32), nullable=False),
    sa.Column('api_key_id', sa.String(length=32), nullable=False),
    sa.Column('csrf_token', sa.String(length=64), nullable=False),
    sa.Column('created_at', service.db.UTCDateTime(timezone=True), nullable=False),
    sa.Column('expires_at', service.db.UTCDateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['api_key_id'], ['api_keys.id'], name=op.f('fk_dashboard_sessions_api_key_id_api_keys'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_dashboard_sessions_tenant_id_tenants'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('token_hash', name=op.f('pk_dashboard_sessions'))
    )
    with op.batch_alter_table('dashboard_sessions', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_dashboard_sessions_expires_at'), ['expires_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_dashboard_sessions_tenant_id'), ['tenant_id'], unique=False)

    op.create_table('job_lookups',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('job_id', sa.String(length=32), nullable=False),
    sa.Column('signature', sa.String(length=64), nullable=False),
    sa.Column('ops', sa.JSON(), nullable=False),
    sa.Column('answer', sa.String(length=64), nullable=False),
    sa.Column('source', sa.String(length=16), nullable=False),
    sa.Column('seconds', sa.Float(), nullable=False),
    sa.Column('created_at', service.db.UTCDateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_job_lookups_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_job_lookups'))
    )
    with op.batch_alter_table('job_lookups', schema=None) as batch_op:
        batch_op.create_index('ix_job_lookups_created', ['created_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_job_lookups_job_id'), ['job_id'], unique=False)
        batch_op.create_index('ix_job_lookups_signature', ['signature', 'job_id'], unique=False)

    op.create_table('job_plans',
    sa.Column('job_id', sa.String(length=32), nullable=False),
    sa.Column('graph', sa.JSON(), nullable=False),
    sa.Column('created_at', service.db.UTCDateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_job_plans_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('job_id', name=op.f('pk_job_plans'))
    )
    op.create_table('profile_runs',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('job_id', sa.String(length=32), nullable=False),
    sa.Column('tenant_id', sa.String(length=32), nullable=False),
    sa.Column('selector', sa.String(length=1000), nullable=False),
    sa.Column('via', sa.String(length=16), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('task_id', sa.String(length=32), nullable=True),
    sa.Column('device_id', sa.String(length=32), nullable=True),
    sa.Column('runs', sa.Integer(), nullable=False),
    sa.Column('warmup', sa.Integer(), nullable=False),
    sa.Column('repeats', sa.Integer(), nullable=False),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('result', sa.JSON(), nullable=True),
    sa.Column('created_at', service.db.UTCDateTime(timezone=True), nullable=False),
    sa.Column('finished_at', service.db.UTCDateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['device_id'], ['devices.id'], name=op.f('fk_profile_runs_device_id_devices'), ondelete='SET NULL'),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_profile_runs_job_id_jobs'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['task_id'], ['measurement_tasks.id'], name=op.f('fk_profile_runs_task_id_measurement_tasks'), ondelete='SET NULL'),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_profile_runs_tenant_id_tenants'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_profile_runs')),
    sa.UniqueConstraint('task_id', name=op.f('uq_profile_runs_task_id'))
    )
    with op.batch_alter_table('profile_runs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_profile_runs_device_id'), ['device_id'], unique=False)
        batch_op.create_index('ix_profile_runs_job', ['job_id', 'created_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_profile_runs_tenant_id'), ['tenant_id'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('profile_runs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_profile_runs_tenant_id'))
        batch_op.drop_index('ix_profile_runs_job')
        batch_op.drop_index(batch_op.f('ix_profile_runs_device_id'))

    op.drop_table('profile_runs')
    op.drop_table('job_plans')
    with op.batch_alter_table('job_lookups', schema=None) as batch_op:
        batch_op.drop_index('ix_job_lookups_signature')
        batch_op.drop_index(batch_op.f('ix_job_lookups_job_id'))
        batch_op.drop_index('ix_job_lookups_created')

    op.drop_table('job_lookups')
    with op.batch_alter_table('dashboard_sessions', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_dashboard_sessions_tenant_id'))
        batch_op.drop_index(batch_op.f('ix_dashboard_sessions_expires_at'))

    op.drop_table('dashboard_sessions')
