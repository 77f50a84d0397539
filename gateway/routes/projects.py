"""Projects and session search (SDK 0.38's RestClient.search_sessions and assign_session_project;
the rules are gateway/projects.py's, the query gateway/session_search.py's)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter

from gateway import session_search, usage
from gateway.errors import error_response
from gateway.identity import audit
from gateway.identity.auth import CallerDep
from gateway.identity.caller import Caller
from gateway.projects import Forbidden, Projects
from gateway.protocol import AssignProjectRequest, SessionSearchRequest, SessionSearchResponse
from gateway.state import Gateway, GatewayDep
from gateway.storage.db import SessionRow, UserRow
from tinkerd.errors import UserError

router = APIRouter(prefix="/api/v1")


@router.post("/sessions/search")
async def search_sessions(body: SessionSearchRequest, caller: CallerDep, gw: GatewayDep) -> SessionSearchResponse:
    return await asyncio.to_thread(session_search.search, gw.db, caller, body, gw.settings.session_timeout_s)


async def movable_session(gw: Gateway, caller: Caller, session_id: str) -> SessionRow:
    """The caller's session, or for an admin any session of their org; else 404."""
    row = gw.db.get(SessionRow, session_id)
    if row is not None and row.owner != caller.user_id and caller.admin:
        owner = gw.db.get(UserRow, row.owner) if row.owner else None
        if owner is not None and owner.org_id == caller.org_id:
            return row
    return await gw.sessions.session(caller, session_id)


# PUT is what SDK 0.38 sends; POST is taken too.
@router.api_route("/sessions/{session_id}/project", methods=["PUT", "POST"])
async def assign_session_project(session_id: str, body: AssignProjectRequest, caller: CallerDep, gw: GatewayDep):
    """Moves the session, with its training runs, samplers and checkpoints, into the project."""
    if not body.project_id:
        raise UserError("project_id is required: a session is always in a project and can only be moved to another")
    row = await movable_session(gw, caller, session_id)
    try:
        project_id = Projects(gw.db).place(caller, body.project_id)
    except Forbidden as e:
        return error_response(str(e), 403)
    if row.project_id != project_id:
        Projects(gw.db).move(session_id, project_id)
        usage.session_moved(gw.db, session_id, project_id)
        audit.record(gw.db, "session_project_assigned", user_id=caller.user_id, org_id=caller.org_id,
                     session_id=session_id, project_id=project_id, previous_project_id=row.project_id)
    return {}
