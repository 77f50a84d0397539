"""Trace spans: one row per request of a session (gateway/traces/spans.py), for the console's session
panels and GET /api/v1/sessions/{id}/trace_export (a Perfetto trace).

Revision ID: 0009_trace_spans
Revises: 0008_snapshot_bytes
"""

import sqlalchemy as sa
from alembic import op

revision = '0009_trace_spans'
down_revision = '0008_snapshot_bytes'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('trace_spans',
    sa.Column('span_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('session_id', sa.String(length=128), nullable=False),
    sa.Column('request_id', sa.String(length=64), nullable=True),
    sa.Column('kind', sa.String(length=64), nullable=False),
    sa.Column('model_id', sa.String(length=256), nullable=True),
    sa.Column('service', sa.String(length=256), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('received_us', sa.BigInteger(), nullable=False),
    sa.Column('started_us', sa.BigInteger(), nullable=True),
    sa.Column('finished_us', sa.BigInteger(), nullable=False),
    sa.Column('tokens_in', sa.Integer(), nullable=False),
    sa.Column('tokens_out', sa.Integer(), nullable=False),
    sa.Column('detail', sa.String(length=512), nullable=False),
    sa.PrimaryKeyConstraint('span_id')
    )
    with op.batch_alter_table('trace_spans', schema=None) as batch_op:
        batch_op.create_index('ix_trace_spans_session', ['session_id', 'span_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_trace_spans_finished_us'), ['finished_us'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('trace_spans', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_trace_spans_finished_us'))
        batch_op.drop_index('ix_trace_spans_session')
    op.drop_table('trace_spans')
