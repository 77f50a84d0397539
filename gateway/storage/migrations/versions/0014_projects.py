"""Projects and session search (SDK 0.38): each session is in a project and may have a display
name and the reason its client gave for finishing; search_sessions walks sessions newest first
through the new indexes. Sessions from before are in their owner's default project.

Revision ID: 0014_projects
Revises: 0013_inflight
"""

import sqlalchemy as sa
from alembic import op

revision = '0014_projects'
down_revision = '0013_inflight'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('projects',
    sa.Column('project_id', sa.String(length=128), nullable=False),
    sa.Column('org_id', sa.String(length=128), nullable=False),
    sa.Column('created_by', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('project_id')
    )
    with op.batch_alter_table('projects', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_projects_created_by'), ['created_by'], unique=False)
    with op.batch_alter_table('sessions', schema=None) as batch_op:
        batch_op.add_column(sa.Column('project_id', sa.String(length=128), nullable=True))
        batch_op.add_column(sa.Column('display_name', sa.String(length=512), nullable=True))
        batch_op.add_column(sa.Column('finish_reason', sa.String(length=16), nullable=True))
        batch_op.add_column(sa.Column('finish_detail', sa.Text(), nullable=True))
        batch_op.create_index('ix_sessions_created', ['created_at', 'session_id'], unique=False)
        batch_op.create_index('ix_sessions_owner_created', ['owner', 'created_at', 'session_id'], unique=False)
        batch_op.create_index('ix_sessions_project_created', ['project_id', 'created_at', 'session_id'],
                              unique=False)
    op.execute("UPDATE sessions SET project_id = 'default-' || "
               "(SELECT users.name FROM users WHERE users.user_id = sessions.owner) WHERE owner IS NOT NULL")


def downgrade() -> None:
    with op.batch_alter_table('sessions', schema=None) as batch_op:
        batch_op.drop_index('ix_sessions_project_created')
        batch_op.drop_index('ix_sessions_owner_created')
        batch_op.drop_index('ix_sessions_created')
        batch_op.drop_column('finish_detail')
        batch_op.drop_column('finish_reason')
        batch_op.drop_column('display_name')
        batch_op.drop_column('project_id')
    with op.batch_alter_table('projects', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_projects_created_by'))
    op.drop_table('projects')
