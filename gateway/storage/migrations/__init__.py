"""The gateway database's schema history (Alembic): gateway/storage/schema.py runs it at start-up."""
