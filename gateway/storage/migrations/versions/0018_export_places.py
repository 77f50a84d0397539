"""Merged-export places counted in the database (gateway/export.py): one row per download being
made, per checkpoint owner across gateways, with a lease its gateway renews.

Revision ID: 0018_export_places
Revises: 0017_sampling_clones
"""

import sqlalchemy as sa
from alembic import op

revision = '0018_export_places'
down_revision = '0017_sampling_clones'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('export_places',
                    sa.Column('place_id', sa.String(length=64), nullable=False),
                    sa.Column('owner', sa.String(length=64), nullable=False),
                    sa.Column('lease_until', sa.DateTime(timezone=True), nullable=False),
                    sa.PrimaryKeyConstraint('place_id'))
    with op.batch_alter_table('export_places', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_export_places_owner'), ['owner'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('export_places', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_export_places_owner'))
    op.drop_table('export_places')
