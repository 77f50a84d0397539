"""The gateway database's schema history (Alembic): gateway/schema.py runs it at start-up."""
