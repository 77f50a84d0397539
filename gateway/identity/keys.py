"""Users and their API keys: who a caller is.

A key is `tml-<key_id>-<secret>`: the id finds the row, the secret (256 random bits) is checked
against its SHA-256 in constant time. Only the hash is stored, so the database never holds a
usable key. `tinkerd keys` (launcher/keys.py) and the gateway share this module; the gateway
keeps what it looked up for a few seconds, so a revoked key stops working within AUTH_CACHE_S.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import re
import secrets
import threading
import time
import uuid

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from gateway.identity import audit
from gateway.identity.caller import Caller  # noqa: F401 - who a key belongs to, as the routes see it
from gateway.storage.db import ApiKeyRow, Database, UserRow, now
from tinkerd.errors import NotFoundError, UserError

AUTH_CACHE_S = 2.0
_KEY_RE = re.compile(r"^tml-([0-9a-f]{16})-([A-Za-z0-9_-]{43})$")
_NAME_RE = re.compile(r"^[A-Za-z0-9_.@-]{1,128}$")


def _sha256(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def create_user(db: Database, name: str, *, org_id: str = "default", email: str = "",
                admin: bool = False) -> UserRow:
    """The user called `name`, made if new (the same name always means the same user)."""
    if not _NAME_RE.match(name) or not _NAME_RE.match(org_id):
        raise UserError(f"user and org names must match {_NAME_RE.pattern}")
    existing = db.select(select(UserRow).where(UserRow.name == name))
    if existing:
        return existing[0]
    row = UserRow(user_id=f"user-{uuid.uuid4().hex[:16]}", name=name, org_id=org_id, email=email, admin=admin)
    try:
        db.add(row)
    except IntegrityError:           # made concurrently by another process
        return db.select(select(UserRow).where(UserRow.name == name))[0]
    return row


def create_key(db: Database, user: UserRow) -> tuple[str, ApiKeyRow]:
    """A new key for `user`: (the key, shown once; its row)."""
    key_id, secret = secrets.token_hex(8), secrets.token_urlsafe(32)
    row = ApiKeyRow(key_id=key_id, user_id=user.user_id, secret_sha256=_sha256(secret))
    db.add(row)
    audit.record(db, "api_key_created", user_id=user.user_id, org_id=user.org_id, key_id=key_id, user_name=user.name)
    return f"tml-{key_id}-{secret}", row


def revoke_key(db: Database, key_or_id: str) -> ApiKeyRow:
    m = _KEY_RE.match(key_or_id)
    key_id = m.group(1) if m else key_or_id
    row = db.get(ApiKeyRow, key_id)
    if row is None:
        raise NotFoundError(f"no API key {key_id!r}")
    if row.revoked_at is None:
        db.touch(ApiKeyRow, key_id, revoked_at=now())
        user = db.get(UserRow, row.user_id)
        audit.record(db, "api_key_revoked", user_id=row.user_id, org_id=user.org_id if user else "", key_id=key_id)
    return db.get(ApiKeyRow, key_id)


def list_keys(db: Database) -> list[tuple[ApiKeyRow, UserRow]]:
    users = {u.user_id: u for u in db.select(select(UserRow))}
    return [(k, users[k.user_id]) for k in db.select(select(ApiKeyRow).order_by(ApiKeyRow.created_at))
            if k.user_id in users]


class KeyStore:
    """Resolves keys (and key ids named in tokens) to callers, caching for AUTH_CACHE_S. Ids with
    no key are remembered apart, at most UNKNOWN_IDS of them (the oldest forgotten first): a flood
    of made-up ids repeats no database read per id and evicts no one's key."""

    UNKNOWN_IDS = 4096

    def __init__(self, db: Database):
        self.db = db
        self._cache: dict[str, tuple[float, ApiKeyRow, UserRow | None]] = {}
        self._unknown: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._unknown_lock = threading.Lock()

    def cached(self, key_id: str) -> bool:
        """Whether looking `key_id` up reads no database (a fresh answer is kept)."""
        hit = self._cache.get(key_id)
        seen = hit[0] if hit is not None else self._unknown.get(key_id)
        return seen is not None and time.monotonic() - seen < AUTH_CACHE_S

    def _lookup(self, key_id: str) -> tuple[ApiKeyRow | None, UserRow | None]:
        hit = self._cache.get(key_id)
        if hit is not None and time.monotonic() - hit[0] < AUTH_CACHE_S:
            return hit[1], hit[2]
        seen = self._unknown.get(key_id)
        if seen is not None and time.monotonic() - seen < AUTH_CACHE_S:
            return None, None
        with self.db.session() as s:          # straight from the database: another process revokes
            key = s.get(ApiKeyRow, key_id)
            user = s.get(UserRow, key.user_id) if key is not None else None
        if key is None:
            with self._unknown_lock:
                self._unknown[key_id] = time.monotonic()
                self._unknown.move_to_end(key_id)
                while len(self._unknown) > self.UNKNOWN_IDS:
                    self._unknown.popitem(last=False)
            return None, None
        if len(self._cache) > 10_000:         # only ids of real keys get here
            self._cache.clear()
        self._cache[key_id] = (time.monotonic(), key, user)
        self._unknown.pop(key_id, None)
        return key, user

    def caller_for_key_id(self, key_id: str) -> Caller | None:
        """The caller of a live (not revoked) key, by its id."""
        key, user = self._lookup(key_id)
        if key is None or user is None or key.revoked_at is not None:
            return None
        return Caller(user.user_id, user.name, user.org_id, user.email, bool(user.admin), key.key_id)

    def key_id_of(self, api_key: str) -> str | None:
        """The id an API key names, None for what is no key at all."""
        m = _KEY_RE.match(api_key)
        return m.group(1) if m else None

    def caller_for_key(self, api_key: str) -> Caller | None:
        m = _KEY_RE.match(api_key)
        if m is None:
            return None
        key, _ = self._lookup(m.group(1))
        if key is None or not hmac.compare_digest(key.secret_sha256, _sha256(m.group(2))):
            return None
        return self.caller_for_key_id(m.group(1))
