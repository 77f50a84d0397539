"""Ephemeral snapshots count in the per-user checkpoint quota (gateway/identity/limits.py): a sampling
session made for one records the snapshot's bytes on disk.

Revision ID: 0008_snapshot_bytes
Revises: 0007_stability_owner
"""

import sqlalchemy as sa
from alembic import op

revision = '0008_snapshot_bytes'
down_revision = '0007_stability_owner'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('sampling_sessions', schema=None) as batch_op:
        batch_op.add_column(sa.Column('snapshot_bytes', sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('sampling_sessions', schema=None) as batch_op:
        batch_op.drop_column('snapshot_bytes')
