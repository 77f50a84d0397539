"""`tinkerd keys`: API keys in the gateway's database (the same --state-dir / --db-url as
`tinkerd up`), usable while the stack runs: the gateway sees a new or revoked key within seconds.

  tinkerd keys create --user NAME [--org ORG] [--email E] [--admin]   prints the key, once
  tinkerd keys list
  tinkerd keys revoke KEY_OR_KEY_ID
  tinkerd keys rotate-signing-key [--keep N]   a new key signs JWTs and download URLs from now on;
                                                the previous N-1 still verify what they signed
"""

from __future__ import annotations

import argparse
import os
import sys

from gateway.identity import keys, signing_keys
from gateway.settings import GatewaySettings, database_url
from gateway.storage import state_dir as private
from gateway.storage.db import Database
from tinkerd import settings, state_lock
from tinkerd.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="keys_command", required=True)
    create = sub.add_parser("create", help="a new API key for a user (made if new); printed once")
    create.add_argument("--user", required=True, help="user name (the same name is the same user)")
    create.add_argument("--org", default="default", help="organization (default: default)")
    create.add_argument("--email", default="", help="the user's email (whoami shows it)")
    create.add_argument("--admin", action="store_true", help="may read the organization's audit log")
    listing = sub.add_parser("list", help="every key: id, user, created, revoked")
    revoke = sub.add_parser("revoke", help="revoke a key (give the key or its id)")
    revoke.add_argument("key")
    rotate = sub.add_parser("rotate-signing-key", help="put a new key first in the signing keys file (running "
                                                       "gateways pick it up within seconds); older keys verify "
                                                       "until dropped")
    rotate.add_argument("--keep", type=int, default=2, help="keys kept in all, the new one included: the oldest "
                                                            "beyond are dropped and what they signed stops working "
                                                            "(default: 2)")
    # The database: the gateway's flags of the same names, so `up`'s values work here too.
    database_flags = tuple(f.name for f in settings.fields(GatewaySettings) if f.name not in ("state_dir", "db_url", "db_password_file"))
    for p in (create, listing, revoke):
        settings.add_arguments(p, GatewaySettings, skip=database_flags)
    settings.add_arguments(rotate, GatewaySettings, skip=tuple(
        f.name for f in settings.fields(GatewaySettings) if f.name not in ("state_dir", "signing_keys_file")))


def open_database(state_dir: str, db_url: str | None, password_file: str = "") -> Database:
    state_lock.make_state_dir(state_dir)
    url = database_url(state_dir, db_url, password_file)
    private.owner_only_database(url)
    return Database(url)


def rotate_signing_key(state_dir: str, signing_keys_file: str, keep: int) -> str:
    """A new first key in the signing keys file (made if missing, like the gateway does)."""
    config = GatewaySettings(base_model="", trainer="", state_dir=state_dir, signing_keys_file=signing_keys_file)
    path = config.signing_keys_path
    if not signing_keys_file:
        state_lock.make_state_dir(state_dir)
        signing_keys.create_if_missing(path)
    return signing_keys.rotate(path, keep)


def new_key(db: Database, user: str, *, org: str = "default", email: str = "", admin: bool = False) -> str:
    key, _ = keys.create_key(db, keys.create_user(db, user, org_id=org, email=email, admin=admin))
    return key


def first_admin_key(state_dir: str, db_url: str | None, password_file: str = "") -> str | None:
    """For `tinkerd up`: on a database without API keys, a key for its admin user (written once to
    write_key_file's file). A database it cannot open ends `up` with the reason."""
    try:
        db = open_database(state_dir, db_url, password_file)
    except UserError as e:
        raise SystemExit(f"tinkerd: {e}") from None
    try:
        return None if keys.list_keys(db) else new_key(db, "admin", admin=True)
    finally:
        db.engine.dispose()


def write_key_file(state_dir: str, key: str) -> str:
    """<state-dir>/admin-api-key, readable by its owner only: `tinkerd up` does not print the key,
    where a terminal's scrollback, a CI log or a supervisor's journal would keep it."""
    path = os.path.join(state_dir, "admin-api-key")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)               # an older file kept its mode through O_CREAT
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return path


def run(args: argparse.Namespace) -> None:
    try:
        _run(args)
    except UserError as e:             # what to fix, not a traceback
        raise SystemExit(f"tinkerd keys: {e}") from None


def _run(args: argparse.Namespace) -> None:
    if args.keys_command == "rotate-signing-key":
        kid = rotate_signing_key(args.state_dir, args.signing_keys_file, args.keep)
        print(f"signing key {kid} signs from now on (gateways re-read the file within "
              f"{signing_keys.RELOAD_S:.0f} s); the previous {args.keep - 1} still verify")
        return
    sqlite = private.sqlite_file(database_url(args.state_dir, args.db_url, args.db_password_file))
    if sqlite and not os.path.exists(sqlite):       # a mistyped --state-dir is a database of its own
        print(f"tinkerd keys: there was no database at {sqlite}; a new one is made. A stack started with another "
              f"--state-dir does not see it: give the one `tinkerd up` runs with.", file=sys.stderr, flush=True)
    db = open_database(args.state_dir, args.db_url, args.db_password_file)
    if args.keys_command == "create":
        print(new_key(db, args.user, org=args.org, email=args.email, admin=args.admin))
    elif args.keys_command == "list":
        for key, user in keys.list_keys(db):
            state = f"revoked {key.revoked_at:%Y-%m-%d %H:%M}" if key.revoked_at else "active"
            print(f"{key.key_id}  {user.name:<20} org={user.org_id:<12} admin={bool(user.admin)!s:<5} "
                  f"created {key.created_at:%Y-%m-%d %H:%M}  {state}")
    else:
        key = keys.revoke_key(db, args.key)
        print(f"revoked {key.key_id}")

