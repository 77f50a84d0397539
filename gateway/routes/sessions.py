"""Client sessions: create, heartbeat, close (ServiceClient.close frees the session's models)."""

from __future__ import annotations

import uuid

from fastapi import APIRouter

from gateway import housekeeping
from gateway.errors import error_response
from gateway.identity import audit
from gateway.identity.auth import CallerDep
from gateway.projects import Forbidden, Projects
from gateway.protocol import CreateSessionRequest, CreateSessionResponse, FinishSessionRequest, SessionHeartbeatRequest
from gateway.state import GatewayDep
from gateway.storage.db import SessionRow, now

router = APIRouter(prefix="/api/v1")


@router.post("/create_session")
async def create_session(body: CreateSessionRequest, caller: CallerDep, gw: GatewayDep) -> CreateSessionResponse:
    """In the project named (made if new; 403 if it is others' and the caller is no member), else
    in the caller's default project (gateway/projects.py)."""
    try:
        session_id = await gw.db.run(_create, gw, caller, body)
    except Forbidden as e:
        return error_response(str(e), 403)
    return CreateSessionResponse(session_id=session_id)


def _create(gw, caller, body: CreateSessionRequest) -> str:
    """The session's row, in its project, admitted by the caller's limits, and its audit event."""
    project_id = Projects(gw.db).place(caller, body.project_id)
    session_id = f"sess-{uuid.uuid4().hex[:12]}"
    gw.db.add_admitted(SessionRow(session_id=session_id, owner=caller.user_id, tags=body.tags,
                                  user_metadata=body.user_metadata, project_id=project_id,
                                  display_name=body.display_name or None), gw.limits.admit_session(caller))
    audit.record(gw.db, "session_created", user_id=caller.user_id, org_id=caller.org_id, session_id=session_id)
    return session_id


@router.post("/session_heartbeat")
async def heartbeat(body: SessionHeartbeatRequest, caller: CallerDep, gw: GatewayDep):
    if (await gw.sessions.session(caller, body.session_id)).finished:      # 410 stops the SDK's heartbeats
        return error_response(f"session {body.session_id} was closed", 410)
    await gw.db.run(gw.db.touch, SessionRow, body.session_id, last_heartbeat=now())
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
async def finish_session(session_id: str, caller: CallerDep, gw: GatewayDep,
                         body: FinishSessionRequest | None = None) -> dict:
    """ServiceClient.close(status, detail): the reason is the session's status in search_sessions."""
    body = body or FinishSessionRequest()
    if await gw.sessions.close(caller, session_id, body.reason and body.reason.type, body.detail):
        await gw.db.run(audit.record, gw.db, "session_closed", user_id=caller.user_id, org_id=caller.org_id,
                        session_id=session_id)
        gw.in_background(housekeeping.release_models(gw, session_id))
    return {}
