"""The database schema is migrated (gateway/storage/schema.py): a new database comes up at the newest
revision, one from before migrations is completed and stamped, and the models in gateway/storage/db.py
never drift from the migrations (a model change without a migration fails here)."""

import sqlalchemy

from gateway.storage import schema
from gateway.storage.db import Base, Database


def _revision(url: str) -> str:
    with sqlalchemy.create_engine(url).connect() as conn:
        return conn.execute(sqlalchemy.text("SELECT version_num FROM alembic_version")).scalar_one()


def _head() -> str:
    from alembic.script import ScriptDirectory

    from gateway.storage.schema import _config
    return ScriptDirectory.from_config(_config(None)).get_current_head()


def test_a_new_database_is_made_by_the_migrations_and_matches_the_models(tmp_path):
    url = f"sqlite:///{tmp_path / 'new.db'}"
    db = Database(url)
    assert _revision(url) == _head()
    assert schema.differences(db.engine, Base.metadata) == []
    Database(url)            # opening it again changes nothing
    assert _revision(url) == _head()


def test_a_database_from_before_migrations_is_completed_and_stamped(tmp_path):
    url = f"sqlite:///{tmp_path / 'old.db'}"
    engine = sqlalchemy.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sqlalchemy.text(
            "CREATE TABLE sessions (session_id VARCHAR(128) PRIMARY KEY, created_at DATETIME, "
            "last_heartbeat DATETIME, tags JSON, user_metadata JSON)"))
        conn.execute(sqlalchemy.text("INSERT INTO sessions VALUES ('s1', NULL, NULL, '[]', '{}')"))
    engine.dispose()
    db = Database(url)
    assert _revision(url) == _head()
    from gateway.storage.db import SessionRow
    row = db.get(SessionRow, "s1")
    assert row.finished is False and row.owner is None
    missing = [d for d in schema.differences(db.engine, Base.metadata) if d[0] in ("add_table", "add_column")]
    assert missing == []


def test_the_row_cache_stays_bounded_when_rows_are_added_and_never_read(tmp_path, monkeypatch):
    """Each add caches its row for a moment; rows added once and never read again (a sampling
    session per RL step) must not stay in the gateway's memory for good."""
    from gateway.storage import db as db_module
    from gateway.storage.db import SamplingSessionRow

    monkeypatch.setattr(db_module, "_CACHE_SWEEP_AT", 16)
    monkeypatch.setattr(db_module, "CACHE_TTL_S", 0.0)      # every entry expired at once
    db = Database(f"sqlite:///{tmp_path / 'cache.db'}")
    for i in range(100):
        db.add(SamplingSessionRow(sampling_session_id=f"s:sample:{i}", session_id="s", base_model="m"))
    assert len(db._cache) <= 16
    monkeypatch.setattr(db_module, "CACHE_TTL_S", 60.0)     # all fresh: cleared, still bounded
    for i in range(100, 200):
        db.add(SamplingSessionRow(sampling_session_id=f"s:sample:{i}", session_id="s", base_model="m"))
    assert len(db._cache) <= 16
    assert db.get(SamplingSessionRow, "s:sample:3").session_id == "s"


def test_a_completions_seq_is_never_reused_after_the_upgrade(tmp_path):
    """0019: a database made at 0018 keeps its queued completions, and once the highest row is
    deleted (acknowledged) the next row still gets a larger seq, so another gateway's watcher,
    which reads rows above the highest seq it has seen, sees it (gateway/futures/completions.py)."""
    from alembic import command

    url = f"sqlite:///{tmp_path / 'at18.db'}"
    engine = sqlalchemy.create_engine(url)
    insert = sqlalchemy.text(
        "INSERT INTO completions (sampling_session_id, clone, request_id, failed, size, finished_at) "
        "VALUES ('s', 0, :rid, 0, 1, '2026-12-06 00:00:00')")
    with engine.begin() as conn:
        command.upgrade(schema._config(conn), "0018_export_places")
        conn.execute(insert, {"rid": "a"})
        conn.execute(insert, {"rid": "b"})
    engine.dispose()
    db = Database(url)
    assert _revision(url) == _head()
    with db.engine.begin() as conn:
        assert conn.execute(sqlalchemy.text("SELECT seq, request_id FROM completions ORDER BY seq")).all() == [
            (1, "a"), (2, "b")]
        conn.execute(sqlalchemy.text("DELETE FROM completions WHERE seq = 2"))
        conn.execute(insert, {"rid": "c"})
        assert conn.execute(sqlalchemy.text("SELECT seq FROM completions WHERE request_id = 'c'")).scalar_one() == 3


def test_every_revision_id_fits_postgres_alembic_version():
    """alembic_version.version_num is VARCHAR(32) on PostgreSQL (SQLite does not enforce it)."""
    from alembic.script import ScriptDirectory

    from gateway.storage.schema import _config
    long = [r.revision for r in ScriptDirectory.from_config(_config(None)).walk_revisions() if len(r.revision) > 32]
    assert long == []
