"""completions.seq never reused on SQLite (AUTOINCREMENT): a rowid alone is reused once the
highest row is deleted, and another gateway's watcher, which reads the rows above the highest seq
it has seen (gateway/futures/completions.py), would never see a row that reused one. PostgreSQL's
sequence never goes back: nothing to do there.

Revision ID: 0019_completions_autoinc
Revises: 0018_export_places
"""

from alembic import op

revision = '0019_completions_autoinc'
down_revision = '0018_export_places'
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        with op.batch_alter_table('completions', recreate='always',
                                  table_kwargs={'sqlite_autoincrement': True}):
            pass      # recreated with the new table options


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        with op.batch_alter_table('completions', recreate='always',
                                  table_kwargs={'sqlite_autoincrement': False}):
            pass      # recreated with the new table options
