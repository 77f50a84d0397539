"""Where the gateway keeps its state: the database tables (db), the schema brought up to date at
start (schema, with the Alembic history in migrations/), the private state dir (state_dir)."""
