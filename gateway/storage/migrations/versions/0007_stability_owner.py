"""Stability records capped per user in bytes (gateway/stability.py): each row says whose it is
and what it costs, indexed so a user's caps drop their own oldest rows. Rows from before get
owner '' and size 0 (they expire with the TTL).

Revision ID: 0007_stability_owner
Revises: 0006_signing_key_out_of_db
"""

import sqlalchemy as sa
from alembic import op

revision = '0007_stability_owner'
down_revision = '0006_signing_key_out_of_db'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('stability_records', schema=None) as batch_op:
        batch_op.add_column(sa.Column('owner', sa.String(length=128), server_default='', nullable=False))
        batch_op.add_column(sa.Column('size_bytes', sa.BigInteger(), server_default='0', nullable=False))
        batch_op.create_index('ix_stability_records_owner', ['owner', 'record_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('stability_records', schema=None) as batch_op:
        batch_op.drop_index('ix_stability_records_owner')
        batch_op.drop_column('size_bytes')
        batch_op.drop_column('owner')
