"""A session's trace: GET /api/v1/sessions/{id}/trace_export (RestClient.export_session_trace,
`tinker session export-trace`) answers at once with a signed URL, and that URL (a plain GET, no
credentials, like a checkpoint archive's) serves the Perfetto trace of the session's requests
recorded up to the moment of the export (gateway/pftrace.py builds it from gateway/traces.py's
rows, at most --trace-spans-per-session of them, so the file's size is bounded).

The SDK polls the export until it is "ready"; a trace is built when downloaded, so it always is.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway import pftrace
from gateway.auth import CallerDep
from gateway.db import SessionRow
from gateway.state import Gateway, GatewayDep
from gateway.traces import now_us
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
    gw.sessions.session(caller, session_id)        # another user's session is a 404 like a missing one
    await flushed(gw)
    path = trace_path(session_id, now_us())
    expires = int(time.time()) + URL_LIFETIME_S
    base = str(request.base_url).rstrip("/")
    url = f"{base}{path}?expires={expires}&signature={gw.signer.url_signature(path, expires)}"
    return {"status": "ready", "url": url, "error": None}


@router.get("/files/session_traces/{session_id}/{until_us}.pftrace")
async def trace_file(session_id: str, until_us: int, request: Request, gw: GatewayDep) -> Response:
    try:
        expires = int(request.query_params.get("expires", ""))
    except ValueError:
        expires = 0
    if not gw.signer.url_valid(trace_path(session_id, until_us), expires, request.query_params.get("signature", "")):
        raise NotFoundError("this download link is unknown or has expired; call export_session_trace again")
    spans = await asyncio.to_thread(gw.traces.of_session, session_id, until_us)
    if not spans and await asyncio.to_thread(gw.db.get, SessionRow, session_id) is None:
        raise NotFoundError(f"unknown session {session_id}")
    body = await asyncio.to_thread(pftrace.build, session_id, spans)
    return Response(body, media_type="application/octet-stream",
                    headers={"Content-Disposition": f'attachment; filename="{session_id}.pftrace"'})

