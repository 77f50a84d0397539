"""Step metrics: one row per training request of a run (gateway/step_metrics.py), for the console.

Revision ID: 0003_step_metrics
Revises: 0001
Created: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op

revision = '0003_step_metrics'
down_revision = '0002_redrive'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('step_metrics',
    sa.Column('model_id', sa.String(length=256), nullable=False),
    sa.Column('seq_id', sa.BigInteger(), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('kind', sa.String(length=32), nullable=False),
    sa.Column('metrics', sa.JSON(), nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('model_id', 'seq_id')
    )


def downgrade() -> None:
    op.drop_table('step_metrics')
