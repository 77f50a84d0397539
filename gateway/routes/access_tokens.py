"""Weights access tokens: an owner mints and revokes them for one checkpoint at a time; another
user passes one as SDK 0.38's weights_access_token (gateway/access_tokens.py has the rules;
routes/weights.py and routes/checkpoints.py take them)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from gateway import access_tokens, checkpoints
from gateway.checkpoints import iso
from gateway.identity.auth import CallerDep
from gateway.protocol import AccessTokensQuery, MintAccessTokenRequest
from gateway.state import GatewayDep
from gateway.storage.db import CheckpointRow, WeightsAccessTokenRow
from tinkerd.errors import NotFoundError

router = APIRouter(prefix="/api/v1")


def _shown(row: WeightsAccessTokenRow) -> dict:
    return {"token_id": row.token_id, "tinker_path": row.tinker_path, "created_at": iso(row.created_at),
            "expires_at": iso(row.expires_at), "revoked_at": iso(row.revoked_at)}


@router.post("/weights_access_tokens")
async def mint(body: MintAccessTokenRequest, caller: CallerDep, gw: GatewayDep) -> dict:
    """A token for one of the caller's checkpoints; the token itself is shown this once."""
    checkpoints.parse_tinker_path(body.tinker_path)
    row = gw.db.get(CheckpointRow, body.tinker_path)
    if row is None or row.owner != caller.user_id:
        raise NotFoundError(f"no checkpoint {body.tinker_path!r} of yours")
    token, stored = access_tokens.mint(gw.db, caller, row, body.ttl_seconds)
    return {"token": token, **_shown(stored)}


@router.get("/weights_access_tokens")
async def list_tokens(query: Annotated[AccessTokensQuery, Query()], caller: CallerDep, gw: GatewayDep) -> dict:
    return {"tokens": [_shown(r) for r in access_tokens.tokens_of(gw.db, caller, query.tinker_path)]}


@router.delete("/weights_access_tokens/{token_id}")
async def revoke(token_id: str, caller: CallerDep, gw: GatewayDep) -> dict:
    return _shown(access_tokens.revoke(gw.db, caller, token_id))
