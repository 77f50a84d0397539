"""retrieve_futures completions in the database: a sample finished on one gateway is reported by a
poll on any other (gateway/futures/completions.py); before, each gateway kept its own in memory.

Revision ID: 0011_completions
Revises: 0010_custom_losses
"""

import sqlalchemy as sa
from alembic import op

revision = '0011_completions'
down_revision = '0010_custom_losses'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('completions',
    sa.Column('seq', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('sampling_session_id', sa.String(length=128), nullable=False),
    sa.Column('clone', sa.BigInteger(), nullable=False),
    sa.Column('request_id', sa.String(length=64), nullable=False),
    sa.Column('failed', sa.Boolean(), nullable=False),
    sa.Column('size', sa.BigInteger(), nullable=False),
    sa.Column('reported_cursor', sa.BigInteger(), nullable=True),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('seq')
    )
    with op.batch_alter_table('completions', schema=None) as batch_op:
        batch_op.create_index('ix_completions_target', ['sampling_session_id', 'clone', 'seq'], unique=False)
        batch_op.create_index(batch_op.f('ix_completions_request_id'), ['request_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_completions_finished_at'), ['finished_at'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('completions', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_completions_finished_at'))
        batch_op.drop_index(batch_op.f('ix_completions_request_id'))
        batch_op.drop_index('ix_completions_target')
    op.drop_table('completions')
