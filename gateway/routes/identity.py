"""Who the caller is: the JWT exchange (`auth/token`; `RestClient.whoami` reads the token's
claims), the caller's own key (`tinker auth` CLI), and the admin's audit log."""

from __future__ import annotations

import datetime
from typing import Annotated

from fastapi import APIRouter, Query

from gateway import audit, keys
from gateway.auth import CallerDep
from gateway.errors import error_response
from gateway.protocol import AuditEntry, AuditLogResponse, AuditQuery, AuthTokenResponse
from gateway.state import GatewayDep

router = APIRouter(prefix="/api/v1")


@router.post("/auth/token")
async def auth_token(caller: CallerDep, gw: GatewayDep) -> AuthTokenResponse:
    return AuthTokenResponse(jwt=gw.signer.token(caller))


@router.get("/auth/apikey/me")
async def my_key(caller: CallerDep) -> dict:
    """The presented key's public metadata (`tinker auth login` checks a pasted key with it)."""
    user = {"user_id": caller.user_id, "user_urn": caller.urn, "name": caller.name, "email": caller.email}
    return {"key_id": int(caller.key_id or "0", 16), "name": caller.name, "note": "",
            "details": {"org_details": {"org_id": caller.org_id, "org_urn": caller.org_urn}, "user_details": user}}


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
