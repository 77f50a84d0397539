"""Baseline: the schema as of 2026-11-23, when migrations began (older databases are completed
and stamped by gateway/storage/schema.py).

Revision ID: 0001
Revises: (none)
Created: 2026-11-23 06:43:35.095990
"""

import sqlalchemy as sa
from alembic import op

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('api_keys',
    sa.Column('key_id', sa.String(length=32), nullable=False),
    sa.Column('user_id', sa.String(length=64), nullable=False),
    sa.Column('secret_sha256', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('key_id')
    )
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_api_keys_user_id'), ['user_id'], unique=False)

    op.create_table('audit_events',
    sa.Column('event_id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('org_id', sa.String(length=128), nullable=False),
    sa.Column('user_id', sa.String(length=64), nullable=False),
    sa.Column('event', sa.String(length=64), nullable=False),
    sa.Column('details', sa.JSON(), nullable=False),
    sa.PrimaryKeyConstraint('event_id')
    )
    with op.batch_alter_table('audit_events', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_audit_events_at'), ['at'], unique=False)
        batch_op.create_index(batch_op.f('ix_audit_events_org_id'), ['org_id'], unique=False)

    op.create_table('checkpoints',
    sa.Column('tinker_path', sa.String(length=768), nullable=False),
    sa.Column('model_id', sa.String(length=256), nullable=False),
    sa.Column('owner', sa.String(length=64), nullable=True),
    sa.Column('checkpoint_type', sa.String(length=16), nullable=False),
    sa.Column('name', sa.String(length=256), nullable=False),
    sa.Column('snapshot_id', sa.String(length=256), nullable=False),
    sa.Column('snapshot_path', sa.Text(), nullable=False),
    sa.Column('directory', sa.Text(), nullable=False),
    sa.Column('size_bytes', sa.BigInteger(), nullable=True),
    sa.Column('public', sa.Boolean(), nullable=False),
    sa.Column('user_metadata', sa.JSON(), nullable=False),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('tinker_path')
    )
    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_checkpoints_model_id'), ['model_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_checkpoints_owner'), ['owner'], unique=False)

    op.create_table('futures',
    sa.Column('request_id', sa.String(length=64), nullable=False),
    sa.Column('idempotency_key', sa.String(length=512), nullable=True),
    sa.Column('fingerprint', sa.String(length=64), nullable=True),
    sa.Column('owner', sa.String(length=64), nullable=True),
    sa.Column('request_type', sa.String(length=64), nullable=False),
    sa.Column('model_id', sa.String(length=256), nullable=True),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('content_type', sa.String(length=64), nullable=True),
    sa.Column('result', sa.LargeBinary(), nullable=True),
    sa.Column('extra', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('completed_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('request_id'),
    sa.UniqueConstraint('idempotency_key')
    )
    with op.batch_alter_table('futures', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_futures_model_id'), ['model_id'], unique=False)

    op.create_table('models',
    sa.Column('model_id', sa.String(length=256), nullable=False),
    sa.Column('session_id', sa.String(length=128), nullable=False),
    sa.Column('owner', sa.String(length=64), nullable=True),
    sa.Column('base_model', sa.String(length=512), nullable=False),
    sa.Column('lora_rank', sa.Integer(), nullable=False),
    sa.Column('lora_config', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('last_request_time', sa.DateTime(timezone=True), nullable=False),
    sa.Column('resident', sa.Boolean(), nullable=False),
    sa.PrimaryKeyConstraint('model_id')
    )
    with op.batch_alter_table('models', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_models_owner'), ['owner'], unique=False)
        batch_op.create_index(batch_op.f('ix_models_session_id'), ['session_id'], unique=False)

    op.create_table('sampler_replicas',
    sa.Column('address', sa.String(length=256), nullable=False),
    sa.Column('registered_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('last_seen', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('address')
    )
    with op.batch_alter_table('sampler_replicas', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_sampler_replicas_last_seen'), ['last_seen'], unique=False)

    op.create_table('sampling_sessions',
    sa.Column('sampling_session_id', sa.String(length=256), nullable=False),
    sa.Column('session_id', sa.String(length=128), nullable=False),
    sa.Column('owner', sa.String(length=64), nullable=True),
    sa.Column('base_model', sa.String(length=512), nullable=False),
    sa.Column('model_path', sa.Text(), nullable=True),
    sa.Column('snapshot_id', sa.String(length=256), nullable=False),
    sa.Column('snapshot_path', sa.Text(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('sampling_session_id')
    )
    with op.batch_alter_table('sampling_sessions', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_sampling_sessions_session_id'), ['session_id'], unique=False)

    op.create_table('server_secrets',
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('value', sa.String(length=128), nullable=False),
    sa.PrimaryKeyConstraint('name')
    )
    op.create_table('sessions',
    sa.Column('session_id', sa.String(length=128), nullable=False),
    sa.Column('owner', sa.String(length=64), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('last_heartbeat', sa.DateTime(timezone=True), nullable=False),
    sa.Column('tags', sa.JSON(), nullable=False),
    sa.Column('user_metadata', sa.JSON(), nullable=False),
    sa.Column('finished', sa.Boolean(), nullable=False),
    sa.PrimaryKeyConstraint('session_id')
    )
    with op.batch_alter_table('sessions', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_sessions_owner'), ['owner'], unique=False)

    op.create_table('users',
    sa.Column('user_id', sa.String(length=64), nullable=False),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('org_id', sa.String(length=128), nullable=False),
    sa.Column('email', sa.String(length=256), nullable=False),
    sa.Column('admin', sa.Boolean(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('user_id'),
    sa.UniqueConstraint('name')
    )


def downgrade() -> None:
    op.drop_table('users')
    with op.batch_alter_table('sessions', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_sessions_owner'))

    op.drop_table('sessions')
    op.drop_table('server_secrets')
    with op.batch_alter_table('sampling_sessions', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_sampling_sessions_session_id'))

    op.drop_table('sampling_sessions')
    with op.batch_alter_table('sampler_replicas', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_sampler_replicas_last_seen'))

    op.drop_table('sampler_replicas')
    with op.batch_alter_table('models', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_models_session_id'))
        batch_op.drop_index(batch_op.f('ix_models_owner'))

    op.drop_table('models')
    with op.batch_alter_table('futures', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_futures_model_id'))

    op.drop_table('futures')
    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_checkpoints_owner'))
        batch_op.drop_index(batch_op.f('ix_checkpoints_model_id'))

    op.drop_table('checkpoints')
    with op.batch_alter_table('audit_events', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_audit_events_org_id'))
        batch_op.drop_index(batch_op.f('ix_audit_events_at'))

    op.drop_table('audit_events')
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_api_keys_user_id'))

    op.drop_table('api_keys')
