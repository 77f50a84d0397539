"""The state dir is private: it holds the database (API key hashes, every user's runs), every
user's checkpoints and snapshots, the logs and, by default, the signing keys. It is made 0700 and
a gateway refuses to start on one that its group or other users may read, write or enter; files the
gateway makes there are 0600 (and `tinkerd` runs with umask 077, so the trainer's and the
sampler's files are too).

Kubernetes volumes with fsGroup get group bits on every mount, and their access is controlled by
who may mount them: --no-private-state-dir skips the check there (deploy/k8s does).
"""

from __future__ import annotations

import os
import stat

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from gateway.identity import signing_keys
from tinkerd import state_lock
from tinkerd.errors import StateDirError

PRIVATE_UMASK = 0o077


def check_private(path: str, what: str, fix_mode: str) -> None:
    """Refuses `path` if its group or other users have any permission on it."""
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
        raise StateDirError(
            f"{what} {path} has mode {mode:04o}: its group or other users may read or change it (the database, "
            f"checkpoints and signing keys are in it). Fix: chmod {fix_mode} {path}  (or start with "
            f"--no-private-state-dir where access is controlled outside, e.g. a Kubernetes volume with fsGroup)")


def _owner_only_file(path: str) -> None:
    """`path` exists, 0600: made so, or an existing one (a database from before) narrowed."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
    if stat.S_IMODE(os.stat(path).st_mode) & 0o077:
        os.chmod(path, 0o600)


def sqlite_file(database_url: str) -> str | None:
    """The SQLite database file `database_url` names; None for another database, or a URL that
    does not parse (Database says so when it opens it)."""
    try:
        url = make_url(database_url)
    except ArgumentError:
        return None
    if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
        return None
    return url.database


def owner_only_database(database_url: str) -> None:
    """A SQLite database file made (or narrowed to) 0600 before SQLite opens it; SQLite gives its
    -wal and -shm files the database's mode. Other databases are left alone."""
    database = sqlite_file(database_url)
    if database and os.path.isdir(os.path.dirname(database) or "."):
        for suffix in ("", "-wal", "-shm", "-journal"):
            if suffix == "" or os.path.exists(database + suffix):
                _owner_only_file(database + suffix)


def prepare(settings) -> str:
    """Before the gateway opens anything: the state dir (made 0700, or refused unless private), its
    SQLite database 0600 (SQLite gives its -wal and -shm files the database's mode), and the
    signing keys file (made 0600 if it is the default one and missing). Returns the keys file."""
    state_lock.make_state_dir(settings.state_dir)
    if settings.private_state_dir:
        check_private(settings.state_dir, "the state dir", "700")
    owner_only_database(settings.database_url)
    path = settings.signing_keys_path
    if not settings.signing_keys_file:
        signing_keys.create_if_missing(path)
        if settings.private_state_dir:
            check_private(path, "the signing keys file", "600")
    return path
