"""Usage for chargeback (SDK 0.38's billing usage): hourly buckets of tokens trained, prefilled
and sampled and checkpoints made, the keys of the work already counted, and each checkpoint's
bytes on disk over its life. Nothing is counted for the time before.

Revision ID: 0015_usage
Revises: 0014_projects
"""

import sqlalchemy as sa
from alembic import op

revision = '0015_usage'
down_revision = '0014_projects'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('usage',
    sa.Column('bucket_start', sa.DateTime(timezone=True), nullable=False),
    sa.Column('owner', sa.String(length=64), nullable=False),
    sa.Column('session_id', sa.String(length=128), nullable=False),
    sa.Column('base_model', sa.String(length=512), nullable=False),
    sa.Column('kind', sa.String(length=32), nullable=False),
    sa.Column('cached', sa.Boolean(), nullable=False),
    sa.Column('quantity', sa.BigInteger(), nullable=False),
    sa.Column('project_id', sa.String(length=128), nullable=True),
    sa.PrimaryKeyConstraint('bucket_start', 'owner', 'session_id', 'base_model', 'kind', 'cached')
    )
    with op.batch_alter_table('usage', schema=None) as batch_op:
        batch_op.create_index('ix_usage_session', ['session_id'], unique=False)
    op.create_table('usage_counted',
    sa.Column('key', sa.String(length=512), nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('key')
    )
    with op.batch_alter_table('usage_counted', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_usage_counted_at'), ['at'], unique=False)
    op.create_table('checkpoint_storage',
    sa.Column('tinker_path', sa.String(length=768), nullable=False),
    sa.Column('since', sa.DateTime(timezone=True), nullable=False),
    sa.Column('until', sa.DateTime(timezone=True), nullable=True),
    sa.Column('size_bytes', sa.BigInteger(), nullable=False),
    sa.Column('owner', sa.String(length=64), nullable=False),
    sa.Column('session_id', sa.String(length=128), nullable=False),
    sa.Column('base_model', sa.String(length=512), nullable=False),
    sa.PrimaryKeyConstraint('tinker_path', 'since')
    )
    with op.batch_alter_table('checkpoint_storage', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_checkpoint_storage_until'), ['until'], unique=False)
        batch_op.create_index(batch_op.f('ix_checkpoint_storage_session_id'), ['session_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('checkpoint_storage', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_checkpoint_storage_session_id'))
        batch_op.drop_index(batch_op.f('ix_checkpoint_storage_until'))
    op.drop_table('checkpoint_storage')
    with op.batch_alter_table('usage_counted', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_usage_counted_at'))
    op.drop_table('usage_counted')
    with op.batch_alter_table('usage', schema=None) as batch_op:
        batch_op.drop_index('ix_usage_session')
    op.drop_table('usage')
