"""Weights access tokens (SDK 0.38's weights_access_token): an owner hands one checkpoint to
another user for a while (gateway/access_tokens.py).

Revision ID: 0016_weights_access_tokens
Revises: 0015_usage
"""

import sqlalchemy as sa
from alembic import op

revision = '0016_weights_access_tokens'
down_revision = '0015_usage'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('weights_access_tokens',
    sa.Column('token_id', sa.String(length=32), nullable=False),
    sa.Column('secret_sha256', sa.String(length=64), nullable=False),
    sa.Column('tinker_path', sa.String(length=768), nullable=False),
    sa.Column('generation', sa.String(length=64), nullable=False),
    sa.Column('owner', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('token_id')
    )
    with op.batch_alter_table('weights_access_tokens', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_weights_access_tokens_owner'), ['owner'], unique=False)
        batch_op.create_index(batch_op.f('ix_weights_access_tokens_tinker_path'), ['tinker_path'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('weights_access_tokens', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_weights_access_tokens_tinker_path'))
        batch_op.drop_index(batch_op.f('ix_weights_access_tokens_owner'))
    op.drop_table('weights_access_tokens')
