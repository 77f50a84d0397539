"""A session's trace: GET /api/v1/sessions/{id}/trace_export (RestClient.export_session_trace,
`tinker session export-trace`) answers at once with a signed URL, and that URL (a plain GET, no
credentials, like a checkpoint archive's) serves the Perfetto trace of the session's requests
recorded up to the moment of the export (gateway/traces/pftrace.py builds it from gateway/traces/spans.py's
rows, at most --trace-spans-per-session of them, so the file's size is bounded).

The SDK polls the export until it is "ready"; a trace is built when downloaded, so it always is.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway import checkpoints, public_url
from gateway.identity.auth import CallerDep
from gateway.identity.caller import Caller
from gateway.identity.tokens import DownloadGrant
from gateway.signed_downloads import GET_HEAD, byte_response, signed_for, url_signer
from gateway.state import Gateway, GatewayDep
from gateway.storage.db import SessionRow
from gateway.traces import pftrace
from gateway.traces.spans import now_us
from tinkerd.errors import NotFoundError

router = APIRouter()

URL_LIFETIME_S = 3600        # the SDK says "expires after about an hour"


def trace_path(session_id: str, until_us: int) -> str:
    return f"/files/session_traces/{session_id}/{until_us}.pftrace"


async def flushed(gw: Gateway) -> None:
    """This gateway's finished spans in the database now (others' are in within traces.FLUSH_S)."""
    await asyncio.to_thread(gw.traces.flush)


@router.get("/api/v1/sessions/{session_id}/trace_export")
async def trace_export(session_id: str, request: Request, caller: CallerDep, gw: GatewayDep) -> dict:
    session = await gw.sessions.session(caller, session_id)     # another user's session is a 404 like a missing one
    await flushed(gw)
    path = trace_path(session_id, now_us())
    grant = _grant(session, path, int(time.time()) + URL_LIFETIME_S, caller)
    url = f"{public_url.base_url(request, gw.settings)}{path}?{gw.signer.url_query(grant)}"
    return {"status": "ready", "url": url, "error": None}


def _grant(session: SessionRow, path: str, expires: int, signer: Caller) -> DownloadGrant:
    """What a trace URL vouches for (gateway/identity/tokens.py), rebuilt at download from the session as it
    is then: the owner's own, made with an API key that is still valid (revoking it ends the URL)."""
    return DownloadGrant(path, expires, signer.key_id, checkpoints.generation(session.created_at),
                         session.owner or "", "owner")


@router.api_route("/files/session_traces/{session_id}/{until_us}.pftrace", methods=GET_HEAD)
async def trace_file(session_id: str, until_us: int, request: Request, gw: GatewayDep) -> Response:
    expires, signer = url_signer(request, gw)
    session = await asyncio.to_thread(gw.db.get, SessionRow, session_id)
    if session is None or signer is None or session.owner != signer.user_id or not signed_for(
            request, gw, _grant(session, trace_path(session_id, until_us), expires, signer)):
        raise NotFoundError("this download link is unknown or has expired; call export_session_trace again")
    spans = await asyncio.to_thread(gw.traces.of_session, session_id, until_us)
    body = await asyncio.to_thread(pftrace.build, session_id, spans)
    return byte_response(request, body, {"Content-Disposition": f'attachment; filename="{session_id}.pftrace"'},
                         "application/octet-stream")

