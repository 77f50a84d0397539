"""A --db-url the gateway cannot use is refused at start with the reason, never the password:
`tinkerd up`, `tinkerd gateway` and `tinkerd keys` printed SQLAlchemy's traceback."""

from __future__ import annotations

import os

import pytest
from conftest import run_tinkerd

from gateway.storage.db import Database, DatabaseUnusable

NOBODY_LISTENS = "postgresql+psycopg://tinkerd:s3cret-pw@127.0.0.1:1/tinkerd"     # port 1: refused at once


@pytest.mark.parametrize("url, says", [
    ("not a url s3cret-pw", "is not a database URL this gateway can use"),
    ("nosuchdb://tinkerd:s3cret-pw@host/db", "is not a database URL this gateway can use"),
    (NOBODY_LISTENS, "cannot open the database at postgresql+psycopg://tinkerd:***@127.0.0.1:1/tinkerd"),
])
def test_a_database_that_cannot_be_used_is_refused_without_its_password(url, says):
    with pytest.raises(DatabaseUnusable) as refused:
        Database(url)
    assert says in str(refused.value) and "s3cret-pw" not in str(refused.value)


@pytest.mark.parametrize("command", [["up", "--port", "0"], ["gateway", "--trainer", "127.0.0.1:1"],
                                     ["keys", "list"]])
def test_each_command_refuses_it_at_once_with_the_reason(tmp_path, tiny_model_dir, command):
    model = [] if command[0] == "keys" else ["--base-model", tiny_model_dir]
    r = run_tinkerd(*command, *model, "--state-dir", str(tmp_path / "s"), "--db-url", NOBODY_LISTENS)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "cannot open the database at postgresql+psycopg://tinkerd:***@127.0.0.1:1/tinkerd" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "s3cret-pw" not in r.stderr + r.stdout
    assert not os.path.exists(tmp_path / "s" / "logs") or not os.listdir(tmp_path / "s" / "logs")   # nothing started


def test_a_password_file_that_cannot_be_read_is_named(tmp_path):
    from gateway.settings import database_url
    from tinkerd.errors import UserError

    with pytest.raises(UserError, match=f"--db-password-file {tmp_path / 'missing'}: No such file or directory"):
        database_url(str(tmp_path), "postgresql+psycopg://tinkerd@db/tinkerd", str(tmp_path / "missing"))
    (tmp_path / "pw").write_text("s3cret-pw\n")
    with pytest.raises(UserError, match="--db-url is not a database URL") as refused:
        database_url(str(tmp_path), "not a url", str(tmp_path / "pw"))
    assert "s3cret-pw" not in str(refused.value)
