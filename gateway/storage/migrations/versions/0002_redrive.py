"""Futures store what re-drives them: the request itself (its arguments and the serialized gRPC
message) and which gateway runs it until when (a lease the owner renews). A pending future whose
lease lapsed is taken over by another gateway (gateway/futures/store.py).

Revision ID: 0002_redrive
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = '0002_redrive'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('futures', schema=None) as batch_op:
        batch_op.add_column(sa.Column('request_args', sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column('request_body', sa.LargeBinary(), nullable=True))
        batch_op.add_column(sa.Column('claimed_by', sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column('lease_until', sa.DateTime(timezone=True), nullable=True))
        batch_op.create_index(batch_op.f('ix_futures_lease_until'), ['lease_until'], unique=False)
        batch_op.create_index(batch_op.f('ix_futures_completed_at'), ['completed_at'], unique=False)
    # Futures left pending by an older gateway: lapsed at once, so the next gateway takes them
    # over (and fails them, saying why: they hold no request to run again).
    op.execute(sa.text("UPDATE futures SET lease_until = created_at WHERE status = 'pending'"))


def downgrade() -> None:
    with op.batch_alter_table('futures', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_futures_completed_at'))
        batch_op.drop_index(batch_op.f('ix_futures_lease_until'))
        batch_op.drop_column('lease_until')
        batch_op.drop_column('claimed_by')
        batch_op.drop_column('request_body')
        batch_op.drop_column('request_args')
