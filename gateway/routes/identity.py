"""Who the caller is: the JWT exchange (`auth/token`; `RestClient.whoami` reads the token's
claims), the caller's own key (`tinker auth` CLI), and the admin's audit log."""

from __future__ import annotations

import datetime
from typing import Annotated

from fastapi import APIRouter, Query, Request

from gateway.errors import error_response
from gateway.identity import audit, keys
from gateway.identity.auth import CallerDep, _credential
from gateway.protocol import AuditEntry, AuditLogResponse, AuditQuery, AuthTokenResponse
from gateway.state import GatewayDep

router = APIRouter(prefix="/api/v1")


@router.post("/auth/token")
async def auth_token(request: Request, caller: CallerDep, gw: GatewayDep) -> AuthTokenResponse:
    """A JWT for the API key presented. A token presented instead (the SDK 0.38 exchanges a JWT
    given as its api_key like a key) gets one that expires when it does: a token never buys
    itself a longer life, so a leaked one ends at its `exp` or with its API key."""
    credential = _credential(request.scope)
    if gw.authenticator.anonymous is None and not credential.startswith("tml-"):
        claims = gw.signer.token_claims(credential)        # the middleware accepted it: valid now
        if claims is None:
            return error_response("expired or invalid token: exchange an API key (tml-...) for a new one", 401)
        return AuthTokenResponse(jwt=gw.signer.token(caller, expires=claims["exp"]))
    return AuthTokenResponse(jwt=gw.signer.token(caller))


@router.get("/auth/apikey/me")
async def my_key(caller: CallerDep) -> dict:
    """The presented key's public metadata (`tinker auth login` checks a pasted key with it)."""
    user = {"user_id": caller.user_id, "user_urn": caller.urn, "name": caller.name, "email": caller.email}
    return {"key_id": int(caller.key_id or "0", 16), "name": caller.name, "note": "",
            "details": {"org_details": {"name": caller.org_id, "org_id": caller.org_id, "org_urn": caller.org_urn},
                        "user_details": user}}


@router.delete("/auth/apikey/me")
async def revoke_my_key(caller: CallerDep, gw: GatewayDep) -> dict:
    """`tinker auth logout`: the presented key revokes itself, and nothing else."""
    if caller.key_id:
        keys.revoke_key(gw.db, caller.key_id)
    return {}


@router.get("/audit")
async def audit_log(query: Annotated[AuditQuery, Query()], caller: CallerDep, gw: GatewayDep):
    """A day (UTC) of the caller's organization's events; admins only."""
    if not caller.admin:
        return error_response("the audit log is for organization admins", 403)
    day = query.day or datetime.datetime.now(datetime.timezone.utc).date()
    rows = audit.day_of(gw.db, caller.org_id, day, query.event_type)
    return AuditLogResponse(entries=[
        AuditEntry(timestamp=row.at.replace(tzinfo=row.at.tzinfo or datetime.timezone.utc).isoformat(),
                   event=row.event, event_details=row.details or {}, model_id=(row.details or {}).get("model_id"),
                   tinker_path=(row.details or {}).get("tinker_path")) for row in rows])
