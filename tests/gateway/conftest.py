"""Fixtures of the gateway's tests that talk to a real database."""

import pytest


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request, tmp_path_factory):
    """An empty database of each kind the gateway runs on: SQLite in a file, and PostgreSQL 16
    (the `pgserver` wheel, harness/postgres.py; skipped where it is not installed)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('db')}/tinkerd.db"
        return
    pytest.importorskip("pgserver")
    from harness.postgres import postgres

    with postgres(tmp_path_factory.mktemp("pg"), "tinkerd") as url:
        yield url
