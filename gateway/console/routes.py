"""The console's page and files (public: they hold no data) and its JSON routes (authenticated
like every API route, each answering only about the caller's own rows)."""

from __future__ import annotations

import asyncio
import os
from typing import Annotated

from fastapi import APIRouter, Query
from fastapi import Request as FastAPIRequest
from fastapi.responses import FileResponse, RedirectResponse
from pydantic import Field
from sqlalchemy import select

from gateway import bodies, step_metrics
from gateway.checkpoints import iso
from gateway.identity.auth import CallerDep
from gateway.openai.tokenizer_work import load, pool
from gateway.protocol import Page, Request, Token
from gateway.sessions import mine
from gateway.state import GatewayDep
from gateway.storage.db import ModelRow, SamplingSessionRow, SessionRow
from gateway.traces import session_metrics
from tinkerd.errors import NotFoundError, UserError

_STATIC = os.path.join(os.path.dirname(__file__), "static")
# Served by name from this list only: no path from the URL reaches the filesystem.
_FILES = {"index.html": "text/html", "console.js": "text/javascript", "console.css": "text/css"}

# On every page and file of the console: its own script and style only (no inline code, so an
# injected string cannot run), never framed (clickjacking: the page holds an API key), and each file
# only as the type it is sent as.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
                               "frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}

# What the queue page counts (gateway/futures/store.py request types); anything else is "other".
QUEUE_TYPES = ("create_model", "forward_backward", "forward", "optim_step", "save_weights",
               "save_sampler_weights", "save_weights_for_sampler", "load_weights", "sample")

page_router = APIRouter()
api_router = APIRouter(prefix="/api/v1/console")
PageDep = Annotated[Page, Query()]


@page_router.get("/console", include_in_schema=False)
async def console_page() -> FileResponse:
    return FileResponse(os.path.join(_STATIC, "index.html"), media_type=_FILES["index.html"],
                        headers=SECURITY_HEADERS)


@page_router.get("/console/", include_in_schema=False)
async def console_slash() -> RedirectResponse:
    return RedirectResponse("/console", headers=SECURITY_HEADERS)


@page_router.get("/console/static/{name}", include_in_schema=False)
async def console_file(name: str) -> FileResponse:
    if name not in _FILES:
        raise NotFoundError(f"the console has no file {name!r}")
    return FileResponse(os.path.join(_STATIC, name), media_type=_FILES[name], headers=SECURITY_HEADERS)


@api_router.get("/training_runs/{run_id}/metrics")
async def run_metrics(run_id: str, caller: CallerDep, gw: GatewayDep) -> dict:
    """Every recorded step of the caller's run (gateway/step_metrics.py), in seq_id order."""
    if not mine(caller, await asyncio.to_thread(gw.db.get, ModelRow, run_id)):
        raise NotFoundError(f"unknown training run {run_id!r}")
    rows = await asyncio.to_thread(step_metrics.of_run, gw.db, run_id)
    return {"training_run_id": run_id,
            "steps": [{"seq_id": r.seq_id, "step": r.step, "kind": r.kind, "metrics": r.metrics, "at": iso(r.at)}
                      for r in rows]}


@api_router.get("/sessions")
async def sessions(page: PageDep, caller: CallerDep, gw: GatewayDep) -> dict:
    """The caller's sessions, newest first, with what /api/v1/sessions leaves out (its ids only)."""
    def read():
        rows = gw.db.select(select(SessionRow).where(SessionRow.owner == caller.user_id)
                            .order_by(SessionRow.created_at.desc()).offset(page.offset).limit(page.limit))
        ids = [r.session_id for r in rows]
        runs = gw.db.select(select(ModelRow).where(ModelRow.session_id.in_(ids))) if ids else []
        samplers = gw.db.select(select(SamplingSessionRow).where(SamplingSessionRow.session_id.in_(ids))) if ids else []
        return rows, runs, samplers
    rows, runs, samplers = await asyncio.to_thread(read)
    return {"sessions": [
        {"session_id": r.session_id, "created_at": iso(r.created_at), "last_heartbeat": iso(r.last_heartbeat),
         "closed": bool(r.finished), "tags": r.tags or [], "user_metadata": r.user_metadata or {},
         "project_id": r.project_id, "display_name": r.display_name,
         "training_run_ids": [m.model_id for m in runs if m.session_id == r.session_id],
         "sampler_ids": [s.sampling_session_id for s in samplers if s.session_id == r.session_id]}
        for r in rows]}


@api_router.get("/sessions/{session_id}/metrics")
async def session_panels(session_id: str, caller: CallerDep, gw: GatewayDep) -> dict:
    """The session page's panels (gateway/traces/session_metrics.py) from its request spans
    (gateway/traces/spans.py): in-flight samples, training utilization, tokens per second, step times,
    latency percentiles and rate-limit refusals."""
    if not mine(caller, await asyncio.to_thread(gw.db.get, SessionRow, session_id)):
        raise NotFoundError(f"unknown session {session_id!r}")

    def read():
        gw.traces.flush()           # this gateway's finished spans, in now
        return gw.traces.of_session(session_id), gw.traces.samples_in_flight(session_id, caller.user_id)
    spans, in_flight = await asyncio.to_thread(read)
    return {"session_id": session_id, "span_budget": gw.settings.trace_spans_per_session,
            **session_metrics.panels(spans, in_flight)}


@api_router.get("/sampling_sessions")
async def sampling_sessions(page: PageDep, caller: CallerDep, gw: GatewayDep) -> dict:
    """The caller's sampling sessions, newest first: which snapshot (or base model) each samples."""
    rows = await asyncio.to_thread(gw.db.select, select(SamplingSessionRow)
                                   .where(SamplingSessionRow.owner == caller.user_id)
                                   .order_by(SamplingSessionRow.created_at.desc())
                                   .offset(page.offset).limit(page.limit))
    return {"sampling_sessions": [
        {"sampling_session_id": r.sampling_session_id, "session_id": r.session_id, "base_model": r.base_model,
         "model_path": r.model_path, "created_at": iso(r.created_at)} for r in rows]}


@api_router.get("/queue")
async def queue(caller: CallerDep, gw: GatewayDep) -> dict:
    """The caller's futures scheduled on this gateway and not finished yet, by request type."""
    pending = {kind: gw.futures.pending_of(caller.user_id, kind) for kind in QUEUE_TYPES}
    total = gw.futures.pending_of(caller.user_id)
    pending["other"] = total - sum(pending.values())
    return {"pending": pending, "total": total}


class TokenizeRequest(Request):
    text: str = Field(max_length=100_000)


# A playground's text, or a completion: more would hold the GIL for tens of ms in one decode call.
MAX_DETOKENIZE = 131_072


class DetokenizeRequest(Request):
    tokens: list[Token] = Field(max_length=MAX_DETOKENIZE)


async def tokenizer(gw, caller) -> object:
    """The base model's tokenizer (the playground's text <-> the token ids asample takes)."""
    if not os.path.isfile(os.path.join(gw.settings.base_model, "tokenizer_config.json")):
        raise UserError(f"this server's base model has no tokenizer the console can use "
                        f"(no tokenizer_config.json in {gw.settings.base_model})")
    try:
        return await pool.run(caller.user_id, load, gw.settings.base_model)
    except (OSError, ValueError) as e:
        raise UserError(f"this server's base model has no tokenizer the console can use: {e}") from None


# Encoding and decoding run in the tokenizer pool (gateway/openai/tokenizer_work.py), not on the loop.
@api_router.post("/tokenize")
async def tokenize(body: TokenizeRequest, caller: CallerDep, gw: GatewayDep) -> dict:
    tok = await tokenizer(gw, caller)
    return {"tokens": await pool.run(caller.user_id, lambda: tok.encode(body.text, add_special_tokens=False))}


@api_router.post("/detokenize")
async def detokenize(request: FastAPIRequest, caller: CallerDep, gw: GatewayDep) -> dict:
    body = await bodies.model_of(request, DetokenizeRequest)      # up to 131,072 ids: off the loop
    tok = await tokenizer(gw, caller)
    if body.tokens and max(body.tokens) >= len(tok):
        raise UserError(f"token id {max(body.tokens)} is outside the vocabulary [0, {len(tok)})")
    return {"text": await pool.run(caller.user_id, tok.decode, body.tokens)}
