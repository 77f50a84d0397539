"""Alembic's entry point: migrations run on the connection gateway/storage/schema.py hands over."""

from alembic import context

from gateway.storage.db import Base

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
