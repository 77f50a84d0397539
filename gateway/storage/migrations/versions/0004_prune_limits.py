"""Pruning and per-user limits across gateways: sampling sessions record when they were last
used (an ephemeral snapshot unused long enough is deleted, gateway/housekeeping.py), and a
partial index on the pending futures lets every gateway count a user's queue from the database
(gateway/identity/limits.py).

Revision ID: 0004_prune_limits
Revises: 0003_step_metrics
"""

import sqlalchemy as sa
from alembic import op

revision = '0004_prune_limits'
down_revision = '0003_step_metrics'
branch_labels = None
depends_on = None

_PENDING = sa.text("status = 'pending'")


def upgrade() -> None:
    with op.batch_alter_table('sampling_sessions', schema=None) as batch_op:
        batch_op.add_column(sa.Column('last_used', sa.DateTime(timezone=True), nullable=True))
    op.create_index('ix_futures_pending', 'futures', ['request_type', 'owner'], unique=False,
                    sqlite_where=_PENDING, postgresql_where=_PENDING)


def downgrade() -> None:
    op.drop_index('ix_futures_pending', table_name='futures', sqlite_where=_PENDING, postgresql_where=_PENDING)
    with op.batch_alter_table('sampling_sessions', schema=None) as batch_op:
        batch_op.drop_column('last_used')
