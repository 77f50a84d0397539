"""Weights access tokens: the owner of a checkpoint hands it to another user without publishing it.

The owner mints a token for one checkpoint (`POST /api/v1/weights_access_tokens`), which expires
(7 days unless asked otherwise, at most a year) and can be revoked at once; another user passes
it as SDK 0.38's `weights_access_token` (create_training_client_from_state*, and copy_weights'
X-Tinker-Weights-Access-Token header) to load or copy that checkpoint, and nothing else: not the
owner's other checkpoints, runs or sessions, and not a checkpoint saved again at the same path
later (a token is bound to the checkpoint as it was when minted). Minting, revoking and every
use are in the audit log. A token is `wat-<token_id>-<secret>`; only the SHA-256 of its secret is
stored. One that does not parse, is unknown, expired, revoked or for another checkpoint is
refused (403) with what is wrong with it.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import re
import secrets

from sqlalchemy import select

from gateway.checkpoints import generation
from gateway.identity import audit
from gateway.identity.caller import Caller
from gateway.storage.db import CheckpointRow, Database, WeightsAccessTokenRow, aware, now
from tinkerd.errors import NotFoundError, UserError

DEFAULT_TTL_S = 7 * 86400
MAX_TTL_S = 365 * 86400
_TOKEN_RE = re.compile(r"^wat-([0-9a-f]{16})-([A-Za-z0-9_-]{43})$")


class TokenRefused(UserError):
    """A weights access token that grants nothing here (HTTP 403)."""


def _sha256(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def mint(db: Database, caller: Caller, row: CheckpointRow, ttl_seconds: int | None) -> tuple[str, WeightsAccessTokenRow]:
    """A new token for `row` (the caller's own checkpoint): (the token, shown once; its row)."""
    ttl = DEFAULT_TTL_S if ttl_seconds is None else ttl_seconds
    if not 60 <= ttl <= MAX_TTL_S:
        raise UserError(f"ttl_seconds must be 60 to {MAX_TTL_S} (a year), got {ttl}")
    token_id, secret = secrets.token_hex(8), secrets.token_urlsafe(32)
    token = WeightsAccessTokenRow(token_id=token_id, secret_sha256=_sha256(secret), tinker_path=row.tinker_path,
                                  generation=generation(row.created_at), owner=caller.user_id, created_at=now(),
                                  expires_at=now() + datetime.timedelta(seconds=ttl))
    db.add(token)
    audit.checkpoint_access(db, "checkpoint_access_token_created", row, user_id=caller.user_id, org_id=caller.org_id,
                            token_id=token_id, expires_at=token.expires_at.isoformat())
    return f"wat-{token_id}-{secret}", token


def tokens_of(db: Database, caller: Caller, tinker_path: str | None) -> list[WeightsAccessTokenRow]:
    stmt = select(WeightsAccessTokenRow).where(WeightsAccessTokenRow.owner == caller.user_id)
    if tinker_path is not None:
        stmt = stmt.where(WeightsAccessTokenRow.tinker_path == tinker_path)
    return db.select(stmt.order_by(WeightsAccessTokenRow.created_at))


def revoke(db: Database, caller: Caller, token_id: str) -> WeightsAccessTokenRow:
    row = db.get(WeightsAccessTokenRow, token_id)
    if row is None or row.owner != caller.user_id:
        raise NotFoundError(f"no weights access token {token_id!r} of yours")
    if row.revoked_at is None:
        db.touch(WeightsAccessTokenRow, token_id, revoked_at=now())
        audit.record(db, "checkpoint_access_token_revoked", user_id=caller.user_id, org_id=caller.org_id,
                     token_id=token_id, tinker_path=row.tinker_path)
    return db.get(WeightsAccessTokenRow, token_id)


async def readable(db: Database, sessions, caller: Caller, path: str, token: str | None, via: str) -> CheckpointRow:
    """The checkpoint at `path` the caller may read: theirs or published (gateway/sessions.py), or
    with `token` the one it grants (TokenRefused where it grants none). Reads of others' are audited."""
    if token is not None:
        return checkpoint_with(db, caller, path, token, via)
    ckpt = await sessions.readable_checkpoint(caller, path)
    audit.read_by_other_user(db, caller, ckpt, via)
    return ckpt


def checkpoint_with(db: Database, caller: Caller, tinker_path: str, token: str, via: str) -> CheckpointRow:
    """The checkpoint at `tinker_path` that `token` grants `caller`; TokenRefused if it grants nothing."""
    m = _TOKEN_RE.match(token)
    row = db.get(WeightsAccessTokenRow, m.group(1)) if m else None
    if row is None or not hmac.compare_digest(row.secret_sha256, _sha256(m.group(2))):
        raise TokenRefused("weights_access_token is not a valid weights access token (wat-...): ask the "
                           "checkpoint's owner for one")
    if row.revoked_at is not None:
        raise TokenRefused(f"weights_access_token {row.token_id} was revoked at {aware(row.revoked_at).isoformat()}")
    if aware(row.expires_at) <= now():
        raise TokenRefused(f"weights_access_token {row.token_id} expired at {aware(row.expires_at).isoformat()}: "
                           f"ask the checkpoint's owner for a new one")
    if row.tinker_path != tinker_path:
        raise TokenRefused(f"weights_access_token {row.token_id} grants {row.tinker_path}, not {tinker_path}")
    ckpt = db.get(CheckpointRow, tinker_path)
    if ckpt is None:
        raise NotFoundError(f"unknown checkpoint {tinker_path!r}")
    if generation(ckpt.created_at) != row.generation:
        raise TokenRefused(f"weights_access_token {row.token_id} was made for an earlier checkpoint at "
                           f"{tinker_path}, since replaced: ask its owner for a new one")
    audit.checkpoint_access(db, "checkpoint_read_by_other_user", ckpt, user_id=caller.user_id, org_id=caller.org_id,
                            via=f"{via} (weights access token {row.token_id})")
    return ckpt
