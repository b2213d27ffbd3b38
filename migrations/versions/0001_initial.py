"""initial schema: tenants, keys, models, jobs, artifacts, devices, profiles

Revision ID: 0001
Revises:
Create Date: 2026-11-21 12:04:07.611903
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
import service.db


revision: str = '0001'
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('tenants',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('created_at', service.db.UTCDateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_tenants')),
    sa.UniqueConstraint('name', name=op.f('uq_tenants_name'))
    )
    op.create_table('api_keys',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('tenant_id', sa.String(length=32), nullable=False),
    sa.Column('prefix', sa.String(length=16), nullable=False),
    sa.Column('key_hash', sa.String(length=64), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('created_at', service.db.UTCDateTime(timezone=True), nullable=False),
    sa.Column('revoked_at', service.db.UTCDateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_api_keys_tenant_id_tenants'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_api_keys')),
    sa.UniqueConstraint('prefix', name=op.f('uq_api_keys_prefix'))
    )
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_api_keys_tenant_id'), ['tenant_id'], unique=False)

    op.create_table('devices',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('tenant_id', sa.String(length=32), nullable=True),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('fingerprint', sa.String(length=64), nullable=False),
    sa.Column('facts', sa.JSON(), nullable=False),
    sa.Column('registered_at', service.db.UTCDateTime(timezone=True), nullable=False),
    sa.Column('last_seen_at', service.db.UTCDateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_devices_tenant_id_tenants'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_devices')),
    sa.UniqueConstraint('fingerprint', name=op.f('uq_devices_fingerprint'))
    )
    with op.batch_alter_table('devices', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_devices_tenant_id'), ['tenant_id'], unique=False)

    op.create_table('models',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('tenant_id', sa.String(length=32), nullable=False),
    sa.Column('sha256', sa.String(length=64), nullable=False),
    sa.Column('size_bytes', sa.BigInteger(), nullable=False),
    sa.Column('filename', sa.String(length=255), nullable=False),
    sa.Column('opset', sa.Integer(), nullable=False),
    sa.Column('inputs', sa.JSON(), nullable=False),
    sa.Column('created_at', service.db.UTCDateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_models_tenant_id_tenants'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_models')),
    sa.UniqueConstraint('tenant_id', 'sha256', name=op.f('uq_models_tenant_id'))
    )
    with op.batch_alter_table('models', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_models_sha256'), ['sha256'], unique=False)
        batch_op.create_index(batch_op.f('ix_models_tenant_id'), ['tenant_id'], unique=False)

    op.create_table('jobs',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('tenant_id', sa.String(length=32), nullable=False),
    sa.Column('model_id', sa.String(length=32), nullable=False),
    sa.Column('target', sa.String(length=32), nullable=False),
    sa.Column('partitioner', sa.String(length=64), nullable=False),
    sa.Column('shapes', sa.JSON(), nullable=False),
    sa.Column('rewrite', sa.Boolean(), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('stage', sa.String(length=32), nullable=True),
    sa.Column('progress', sa.Integer(), nullable=False),
    sa.Column('stage_seconds', sa.JSON(), nullable=False),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('report', sa.JSON(), nullable=True),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.Column('worker', sa.String(length=200), nullable=True),
    sa.Column('heartbeat_at', service.db.UTCDateTime(timezone=True), nullable=True),
    sa.Column('created_at', service.db.UTCDateTime(timezone=True), nullable=False),
    sa.Column('enqueued_at', service.db.UTCDateTime(timezone=True), nullable=True),
    sa.Column('started_at', service.db.UTCDateTime(timezone=True), nullable=True),
    sa.Column('finished_at', service.db.UTCDateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['model_id'], ['models.id'], name=op.f('fk_jobs_model_id_models'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_jobs_tenant_id_tenants'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_jobs'))
    )
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_jobs_model_id'), ['model_id'], unique=False)
        batch_op.create_index('ix_jobs_state_enqueued', ['state', 'enqueued_at'], unique=False)
        batch_op.create_index('ix_jobs_state_heartbeat', ['state', 'heartbeat_at'], unique=False)
        batch_op.create_index('ix_jobs_tenant_created', ['tenant_id', 'created_at'], unique=False)

    op.create_table('profile_entries',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('device_id', sa.String(length=32), nullable=False),
    sa.Column('signature', sa.String(length=64), nullable=False),
    sa.Column('schedule', sa.String(length=500), nullable=False),
    sa.Column('block', sa.Text(), nullable=False),
    sa.Column('median_s', sa.Float(), nullable=False),
    sa.Column('p10_s', sa.Float(), nullable=False),
    sa.Column('p90_s', sa.Float(), nullable=False),
    sa.Column('n', sa.Integer(), nullable=False),
    sa.Column('source', sa.String(length=16), nullable=False),
    sa.Column('toolchain', sa.String(length=200), nullable=False),
    sa.Column('created_at', service.db.UTCDateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['device_id'], ['devices.id'], name=op.f('fk_profile_entries_device_id_devices'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_profile_entries')),
    sa.UniqueConstraint('device_id', 'signature', 'schedule', name=op.f('uq_profile_entries_device_id'))
    )
    with op.batch_alter_table('profile_entries', schema=None) as batch_op:
        batch_op.create_index('ix_profile_entries_lookup', ['device_id', 'signature', 'median_s'], unique=False)

    op.create_table('artifacts',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('job_id', sa.String(length=32), nullable=False),
    sa.Column('tenant_id', sa.String(length=32), nullable=False),
    sa.Column('path', sa.String(length=500), nullable=False),
    sa.Column('sha256', sa.String(length=64), nullable=False),
    sa.Column('size_bytes', sa.BigInteger(), nullable=False),
    sa.Column('created_at', service.db.UTCDateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_artifacts_job_id_jobs'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_artifacts_tenant_id_tenants'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_artifacts')),
    sa.UniqueConstraint('job_id', name=op.f('uq_artifacts_job_id'))
    )
    with op.batch_alter_table('artifacts', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_artifacts_tenant_id'), ['tenant_id'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('artifacts', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_artifacts_tenant_id'))

    op.drop_table('artifacts')
    with op.batch_alter_table('profile_entries', schema=None) as batch_op:
        batch_op.drop_index('ix_profile_entries_lookup')

    op.drop_table('profile_entries')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index('ix_jobs_tenant_created')
        batch_op.drop_index('ix_jobs_state_heartbeat')
        batch_op.drop_index('ix_jobs_state_enqueued')
        batch_op.drop_index(batch_op.f('ix_jobs_model_id'))

    op.drop_table('jobs')
    with op.batch_alter_table('models', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_models_tenant_id'))
        batch_op.drop_index(batch_op.f('ix_models_sha256'))

    op.drop_table('models')
    with op.batch_alter_table('devices', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_devices_tenant_id'))

    op.drop_table('devices')
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_api_keys_tenant_id'))

    op.drop_table('api_keys')
    op.drop_table('tenants')
