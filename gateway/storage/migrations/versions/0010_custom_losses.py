"""Server-side custom losses (create_custom_loss): each checked graph in the database, so every
gateway can send it with the session's forward_backward requests.

Revision ID: 0010_custom_losses
Revises: 0009_trace_spans
"""

import sqlalchemy as sa
from alembic import op

revision = '0010_custom_losses'
down_revision = '0009_trace_spans'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('custom_losses',
    sa.Column('loss_id', sa.String(length=256), nullable=False),
    sa.Column('session_id', sa.String(length=128), nullable=False),
    sa.Column('owner', sa.String(length=64), nullable=True),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('spec_json', sa.Text(), nullable=False),
    sa.Column('digest', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('loss_id')
    )
    with op.batch_alter_table('custom_losses', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_custom_losses_session_id'), ['session_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('custom_losses', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_custom_losses_session_id'))
    op.drop_table('custom_losses')
