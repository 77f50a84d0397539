"""join_sampling_session (SDK 0.38): each sampling session counts the clones that joined it, so
every unpickled SamplingClient gets a clone id of its own (its request seq_ids never collide).

Revision ID: 0017_sampling_clones
Revises: 0016_weights_access_tokens
"""

import sqlalchemy as sa
from alembic import op

revision = '0017_sampling_clones'
down_revision = '0016_weights_access_tokens'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('sampling_sessions', schema=None) as batch_op:
        batch_op.add_column(sa.Column('clones', sa.BigInteger(), server_default='0', nullable=False))


def downgrade() -> None:
    with op.batch_alter_table('sampling_sessions', schema=None) as batch_op:
        batch_op.drop_column('clones')
