"""A training run's optimizer, chosen when it is created and fixed for its life ("adamw" or
"dimuon"): get_info and weights_info report it, optim_step refuses the other one's parameters.
Runs from before were all AdamW.

Revision ID: 0012_run_optimizer
Revises: 0011_completions
"""

import sqlalchemy as sa
from alembic import op

revision = '0012_run_optimizer'
down_revision = '0011_completions'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('models', schema=None) as batch_op:
        batch_op.add_column(sa.Column('optimizer', sa.String(length=16), server_default='adamw', nullable=False))


def downgrade() -> None:
    with op.batch_alter_table('models', schema=None) as batch_op:
        batch_op.drop_column('optimizer')
