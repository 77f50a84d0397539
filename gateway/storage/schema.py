"""The database schema, brought to the newest revision when a gateway starts: Alembic migrations
in gateway/storage/migrations/versions/, one per schema change (tests/unit/test_schema.py fails when the
models in gateway/storage/db.py and the migrations disagree).

A database from before migrations (tables but no alembic_version) is first completed the old
way -- missing tables made, missing columns added -- and then stamped at the newest revision.
The models' MetaData comes in as an argument: gateway/storage/db.py calls this module, never the reverse.
Several gateways starting at once on one Postgres take turns (a transaction-scoped advisory lock).
"""

from __future__ import annotations

import logging
import os

from sqlalchemy import MetaData, inspect, literal, text
from sqlalchemy.engine import Connection, Engine

log = logging.getLogger(__name__)

_LOCK_KEY = 0x74696E6B   # "tink": the advisory lock migrations take on Postgres


def _config(connection: Connection):
    from alembic.config import Config

    from gateway.storage import migrations

    config = Config()
    config.set_main_option("script_location", os.path.dirname(migrations.__file__))
    config.attributes["connection"] = connection
    return config


def upgrade(engine: Engine, metadata: MetaData) -> None:
    """The database at the newest revision; `metadata` (gateway/storage/db.py's models) completes a
    database from before migrations."""
    from alembic import command
    from alembic.runtime.migration import MigrationContext

    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _LOCK_KEY})
        config = _config(conn)
        tables = set(inspect(conn).get_table_names())
        if tables and "alembic_version" not in tables:
            added = _complete_legacy(conn, metadata)
            command.stamp(config, "head")
            log.info("database from before migrations: added %s, stamped at the newest revision", added)
        before = MigrationContext.configure(conn).get_current_revision()
        command.upgrade(config, "head")
        after = MigrationContext.configure(conn).get_current_revision()
        if before != after:
            log.info("database schema upgraded from %s to %s", before, after)


def _complete_legacy(conn: Connection, metadata: MetaData) -> list[str]:
    """Missing tables and columns of a database made before migrations existed. Old rows get a
    new column's scalar default, or NULL where the default is computed (JSON, timestamps)."""
    metadata.create_all(conn)
    have_tables = inspect(conn)
    added = []
    for table in metadata.sorted_tables:
        have = {c["name"] for c in have_tables.get_columns(table.name)}
        for column in table.columns:
            if column.name in have:
                continue
            ddl = f"ALTER TABLE {table.name} ADD COLUMN {column.name} {column.type.compile(conn.dialect)}"
            default = column.default
            if default is not None and default.is_scalar:
                value = literal(default.arg, column.type).compile(dialect=conn.dialect,
                                                                 compile_kwargs={"literal_binds": True})
                ddl += f" DEFAULT {value}"
            conn.execute(text(ddl))
            added.append(f"{table.name}.{column.name}")
    return added


def differences(engine: Engine, metadata: MetaData) -> list:
    """What the models (`metadata`, gateway/storage/db.py's) have that the migrated database lacks, or the reverse."""
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return compare_metadata(MigrationContext.configure(conn), metadata)
