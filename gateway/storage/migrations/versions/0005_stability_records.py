"""Stability records for stable_reinforce in the database (gateway/stability.py), not in one
gateway's memory: a step reaching any gateway finds the sequences sampled through another.

Revision ID: 0005_stability_records
Revises: 0004_prune_limits
"""

import sqlalchemy as sa
from alembic import op

revision = '0005_stability_records'
down_revision = '0004_prune_limits'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('stability_records',
    sa.Column('record_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('sequence_id', sa.String(length=128), nullable=False),
    sa.Column('session_id', sa.String(length=128), nullable=False),
    sa.Column('tokens', sa.LargeBinary(), nullable=False),
    sa.Column('logprobs', sa.LargeBinary(), nullable=False),
    sa.Column('used', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('record_id'),
    sa.UniqueConstraint('sequence_id')
    )
    with op.batch_alter_table('stability_records', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_stability_records_used'), ['used'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('stability_records', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_stability_records_used'))
    op.drop_table('stability_records')
