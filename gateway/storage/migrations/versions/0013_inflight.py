"""Inflight sampling clients (SDK 0.38 kind="inflight"): each training model's shared inflight
weights, and the sampling sessions that follow them.

Revision ID: 0013_inflight
Revises: 0012_run_optimizer
"""

import sqlalchemy as sa
from alembic import op

revision = '0013_inflight'
down_revision = '0012_run_optimizer'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('inflight_targets',
    sa.Column('model_id', sa.String(length=256), nullable=False),
    sa.Column('seq_id', sa.BigInteger(), nullable=False),
    sa.Column('snapshot_id', sa.String(length=256), nullable=False),
    sa.Column('snapshot_path', sa.Text(), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('model_id')
    )
    with op.batch_alter_table('sampling_sessions', schema=None) as batch_op:
        batch_op.add_column(sa.Column('inflight_model_id', sa.String(length=256), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('sampling_sessions', schema=None) as batch_op:
        batch_op.drop_column('inflight_model_id')
    op.drop_table('inflight_targets')
