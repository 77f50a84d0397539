"""The signing secret leaves the database: JWTs and download URLs are signed with keys from the
signing keys file (gateway/identity/signing_keys.py). The old secret is dropped, not moved: the database
was often readable by others, so whoever read it could forge tokens with it.

Revision ID: 0006_signing_key_out_of_db
Revises: 0005_stability_records
"""

import sqlalchemy as sa
from alembic import op

revision = '0006_signing_key_out_of_db'
down_revision = '0005_stability_records'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_table('server_secrets')


def downgrade() -> None:
    # Empty: a gateway of before makes itself a new secret (and old tokens end).
    op.create_table('server_secrets',
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('value', sa.String(length=128), nullable=False),
    sa.PrimaryKeyConstraint('name')
    )
