"""profiling database: agents, devices, measurement tasks, profile entries by device class

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21 14:40:00

The 0001 `devices` and `profile_entries` tables were placeholders nothing wrote to; they are
replaced by the device-agent schema (devices keyed by agent and name, entries keyed by device
fingerprint, signature and schedule).
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
import service.db


revision: str = '0002'
down_revision: str | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('profile_entries', schema=None) as batch_op:
        batch_op.drop_index('ix_profile_entries_lookup')
    op.drop_table('profile_entries')
    with op.batch_alter_table('devices', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_devices_tenant_id'))
    op.drop_table('devices')

    op.create_table('agents',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('token_prefix', sa.String(length=16), nullable=False),
    sa.Column('token_hash', sa.String(length=64), nullable=False),
    sa.Column('version', sa.String(length=64), nullable=False),
    sa.Column('created_at', service.db.UTCDateTime(timezone=True), nullable=False),
    sa.Column('last_seen_at', service.db.UTCDateTime(timezone=True), nullable=True),
    sa.Column('revoked_at', service.db.UTCDateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_agents')),
    sa.UniqueConstraint('name', name=op.f('uq_agents_name')),
    sa.UniqueConstraint('token_prefix', name=op.f('uq_agents_token_prefix'))
    )
    op.create_table('devices',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('agent_id', sa.String(length=32), nullable=False),
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('transport', sa.String(length=16), nullable=False),
    sa.Column('address', sa.String(length=256), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('arch', sa.String(length=32), nullable=False),
    sa.Column('fingerprint', sa.String(length=64), nullable=False),
    sa.Column('facts', sa.JSON(), nullable=False),
    sa.Column('emulated', sa.Boolean(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('registered_at', service.db.UTCDateTime(timezone=True), nullable=False),
    sa.Column('last_heartbeat_at', service.db.UTCDateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['agent_id'], ['agents.id'], name=op.f('fk_devices_agent_id_agents'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_devices')),
    sa.UniqueConstraint('agent_id', 'name', name=op.f('uq_devices_agent_id'))
    )
    with op.batch_alter_table('devices', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_devices_fingerprint'), ['fingerprint'], unique=False)
        batch_op.create_index('ix_devices_status_heartbeat', ['status', 'last_heartbeat_at'], unique=False)

    op.create_table('measurement_tasks',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('artifact_path', sa.String(length=500), nullable=False),
    sa.Column('artifact_sha256', sa.String(length=64), nullable=False),
    sa.Column('arch', sa.String(length=32), nullable=False),
    sa.Column('device_fingerprint', sa.String(length=64), nullable=True),
    sa.Column('signature', sa.String(length=64), nullable=True),
    sa.Column('schedule', sa.String(length=1000), nullable=False),
    sa.Column('kernels', sa.JSON(), nullable=False),
    sa.Column('toolchain', sa.String(length=200), nullable=False),
    sa.Column('runs', sa.Integer(), nullable=False),
    sa.Column('warmup', sa.Integer(), nullable=False),
    sa.Column('repeats', sa.Integer(), nullable=False),
    sa.Column('threads', sa.Integer(), nullable=True),
    sa.Column('timeout_s', sa.Float(), nullable=False),
    sa.Column('priority', sa.Integer(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('device_id', sa.String(length=32), nullable=True),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.Column('max_attempts', sa.Integer(), nullable=False),
    sa.Column('lease_expires_at', service.db.UTCDateTime(timezone=True), nullable=True),
    sa.Column('deadline', service.db.UTCDateTime(timezone=True), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('entries', sa.Integer(), nullable=False),
    sa.Column('created_at', service.db.UTCDateTime(timezone=True), nullable=False),
    sa.Column('claimed_at', service.db.UTCDateTime(timezone=True), nullable=True),
    sa.Column('finished_at', service.db.UTCDateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['device_id'], ['devices.id'], name=op.f('fk_measurement_tasks_device_id_devices'), ondelete='SET NULL'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_measurement_tasks'))
    )
    with op.batch_alter_table('measurement_tasks', schema=None) as batch_op:
        batch_op.create_index('ix_measurement_tasks_device', ['device_id', 'status'], unique=False)
        batch_op.create_index('ix_measurement_tasks_lease', ['status', 'lease_expires_at'], unique=False)
        batch_op.create_index('ix_measurement_tasks_queue', ['status', 'arch', 'priority', 'created_at'], unique=False)
        batch_op.create_index('ix_measurement_tasks_signature', ['signature', 'device_fingerprint', 'status'], unique=False)

    op.create_table('profile_blocks',
    sa.Column('signature', sa.String(length=64), nullable=False),
    sa.Column('description', sa.Text(), nullable=False),
    sa.PrimaryKeyConstraint('signature', name=op.f('pk_profile_blocks'))
    )
    op.create_table('profile_entries',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('device_fingerprint', sa.String(length=64), nullable=False),
    sa.Column('signature', sa.String(length=64), nullable=False),
    sa.Column('schedule', sa.String(length=1000), nullable=False),
    sa.Column('median_s', sa.Float(), nullable=False),
    sa.Column('p10_s', sa.Float(), nullable=False),
    sa.Column('p90_s', sa.Float(), nullable=False),
    sa.Column('n', sa.Integer(), nullable=False),
    sa.Column('source', sa.String(length=16), nullable=False),
    sa.Column('toolchain', sa.String(length=200), nullable=False),
    sa.Column('created_at', service.db.UTCDateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_profile_entries')),
    sa.UniqueConstraint('device_fingerprint', 'signature', 'schedule', name=op.f('uq_profile_entries_device_fingerprint'))
    )
    with op.batch_alter_table('profile_entries', schema=None) as batch_op:
        batch_op.create_index('ix_profile_entries_best', ['device_fingerprint', 'signature', 'median_s'], unique=False)


def downgrade() -> None:
    op.drop_table('profile_entries')
    op.drop_table('profile_blocks')
    op.drop_table('measurement_tasks')
    op.drop_table('devices')
    op.drop_table('agents')
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

