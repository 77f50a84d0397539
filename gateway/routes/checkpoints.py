"""The REST registry the SDK's RestClient reads: training runs, their checkpoints (list,
publish, ttl, delete), weights_info, copy_weights, sessions. The signed download links of a
checkpoint's files are routes/download_links.py."""

from __future__ import annotations

import hashlib
import uuid
from typing import Annotated

from fastapi import APIRouter, Query, Request
from sqlalchemy import select

from gateway import access_tokens, checkpoints, usage
from gateway.identity import audit
from gateway.identity.auth import CallerDep
from gateway.errors import error_response
from gateway.identity.caller import Caller
from gateway.projects import Forbidden, Projects
from gateway.sessions import mine
from gateway.storage.db import CheckpointRow, ModelRow, SamplingSessionRow, SessionRow
from gateway.protocol import (CheckpointsResponse, CopyWeightsRequest, CopyWeightsResponse, Cursor,
                              Page, RunsPage, SessionResponse, SessionsResponse, SetTtlRequest,
                              TrainingRun, TrainingRunsResponse, WeightsInfoRequest, WeightsInfoResponse,
                              optimizer_config)
from gateway.state import Gateway, GatewayDep
from tinkerd.errors import NotFoundError, UserError

router = APIRouter(prefix="/api/v1")
PageDep = Annotated[Page, Query()]
CHECKPOINT = checkpoints.CHECKPOINT_ROUTE


def _run(gw: Gateway, caller: Caller, run_id: str) -> ModelRow:
    row = gw.db.get(ModelRow, run_id)
    if not mine(caller, row):
        raise NotFoundError(f"unknown training run {run_id!r}")
    return row


async def checkpoint_of(gw: Gateway, caller: Caller, run_id: str, checkpoint_id: str, *, change: bool) -> CheckpointRow:
    return await gw.sessions.checkpoint(caller, run_id, checkpoint_id, change=change)


def _changed(gw: Gateway, caller: Caller, event: str, row: CheckpointRow, **details) -> None:
    audit.record(gw.db, event, user_id=caller.user_id, org_id=caller.org_id, model_id=row.model_id,
                 tinker_path=row.tinker_path, **details)


def _visible(request: Request, stmt):
    """SDKs before 0.28 know checkpoint types "training" and "sampler" only and fail to parse a
    list holding an external one; they cannot make one either, so their lists leave them out."""
    try:
        version = tuple(int(p) for p in request.headers.get("x-stainless-package-version", "").split(".")[:2])
    except ValueError:
        return stmt
    if len(version) == 2 and version < (0, 28):
        return stmt.where(CheckpointRow.checkpoint_type != "external")
    return stmt


@router.get("/training_runs")
async def list_runs(page: Annotated[RunsPage, Query()], caller: CallerDep, gw: GatewayDep) -> TrainingRunsResponse:
    stmt = select(ModelRow).where(ModelRow.owner == caller.user_id).order_by(ModelRow.created_at)
    if page.project_id is not None:         # a run is in its session's project
        stmt = stmt.where(ModelRow.session_id.in_(select(SessionRow.session_id).where(
            SessionRow.project_id == page.project_id)))
    rows = gw.db.select(stmt.offset(page.offset).limit(page.limit))
    return TrainingRunsResponse(training_runs=[checkpoints.run_json(gw.db, r) for r in rows],
                                cursor=Cursor(offset=page.offset, limit=page.limit, total_count=gw.db.count(stmt)))


@router.get("/training_runs/{run_id}")
async def get_run(run_id: str, caller: CallerDep, gw: GatewayDep) -> TrainingRun:
    return checkpoints.run_json(gw.db, _run(gw, caller, run_id))


@router.get("/training_runs/{run_id}/checkpoints")
async def list_run_checkpoints(run_id: str, request: Request, caller: CallerDep, gw: GatewayDep) -> CheckpointsResponse:
    _run(gw, caller, run_id)
    stmt = select(CheckpointRow).where(CheckpointRow.model_id == run_id).order_by(CheckpointRow.created_at)
    rows = gw.db.select(_visible(request, stmt))
    return CheckpointsResponse(checkpoints=[checkpoints.checkpoint_json(c) for c in rows],
                               cursor=Cursor(offset=0, limit=len(rows), total_count=len(rows)))


@router.get("/checkpoints")
async def list_all_checkpoints(request: Request, page: PageDep, caller: CallerDep, gw: GatewayDep) -> CheckpointsResponse:
    stmt = _visible(request, select(CheckpointRow).where(CheckpointRow.owner == caller.user_id)
                    .order_by(CheckpointRow.created_at))
    rows = gw.db.select(stmt.offset(page.offset).limit(page.limit))
    return CheckpointsResponse(checkpoints=[checkpoints.checkpoint_json(c) for c in rows],
                               cursor=Cursor(offset=page.offset, limit=page.limit, total_count=gw.db.count(stmt)))


async def _update(gw: Gateway, caller: Caller, run_id: str, checkpoint_id: str, event: str, values: dict,
            **details) -> dict:
    """The owner changes a checkpoint's row; the audit log records it."""
    row = await checkpoint_of(gw, caller, run_id, checkpoint_id, change=True)
    gw.db.touch(CheckpointRow, row.tinker_path, **values)
    _changed(gw, caller, event, row, **details)
    return {}


@router.post(CHECKPOINT + "/publish")
async def publish(run_id: str, checkpoint_id: str, caller: CallerDep, gw: GatewayDep) -> dict:
    return await _update(gw, caller, run_id, checkpoint_id, "checkpoint_published", {"public": True})


@router.delete(CHECKPOINT + "/publish")
async def unpublish(run_id: str, checkpoint_id: str, caller: CallerDep, gw: GatewayDep) -> dict:
    return await _update(gw, caller, run_id, checkpoint_id, "checkpoint_unpublished", {"public": False})


@router.put(CHECKPOINT + "/ttl")
async def set_ttl(run_id: str, checkpoint_id: str, body: SetTtlRequest, caller: CallerDep, gw: GatewayDep) -> dict:
    return await _update(gw, caller, run_id, checkpoint_id, "checkpoint_ttl_set",
                   {"expires_at": checkpoints.expires(body.ttl_seconds)}, ttl_seconds=body.ttl_seconds)


@router.delete(CHECKPOINT)
async def delete(run_id: str, checkpoint_id: str, caller: CallerDep, gw: GatewayDep) -> dict:
    row = await checkpoint_of(gw, caller, run_id, checkpoint_id, change=True)
    gw.db.delete(CheckpointRow, row.tinker_path)
    usage.checkpoint_gone(gw.db, row.tinker_path)
    checkpoints.delete_checkpoint_files(row)
    _changed(gw, caller, "checkpoint_deleted", row)
    return {}


@router.post("/weights_info")
async def weights_info(body: WeightsInfoRequest, caller: CallerDep, gw: GatewayDep) -> WeightsInfoResponse:
    checkpoints.parse_tinker_path(body.tinker_path)
    row = await gw.sessions.readable_checkpoint(caller, body.tinker_path)
    audit.read_by_other_user(gw.db, caller, row, "weights_info")
    run = gw.db.get(ModelRow, row.model_id)
    lora = run.lora_config or {}
    return WeightsInfoResponse(base_model=run.base_model, lora_rank=run.lora_rank,
                               optimizer_config=optimizer_config(run.optimizer),
                               train_unembed=lora.get("train_unembed", True), train_mlp=lora.get("train_mlp", True),
                               train_attn=lora.get("train_attn", True))


@router.post("/copy_weights")
async def copy_weights(body: CopyWeightsRequest, request: Request, caller: CallerDep,
                       gw: GatewayDep) -> CopyWeightsResponse:
    """The run is `{session_id}:train:{model_seq_id}` when the client names its session (SDK
    0.30), else run 0 of a new session for the project, named from the idempotency key so that a
    resent request finds the copy it made. The source is the caller's, published, or granted by a
    weights access token (its X-Tinker-Weights-Access-Token header)."""
    checkpoints.parse_tinker_path(body.source_path)
    token = request.headers.get("x-tinker-weights-access-token") or body.weights_access_token
    try:
        source = await access_tokens.readable(gw.db, gw.sessions, caller, body.source_path, token, "copy_weights")
    except access_tokens.TokenRefused as e:
        return error_response(str(e), 403)
    gw.limits.check_checkpoint_bytes(caller)
    try:
        session_id = await _copy_session(gw, caller, body, request.headers.get("x-idempotency-key") or uuid.uuid4().hex)
    except Forbidden as e:
        return error_response(str(e), 403)
    run_id = f"{session_id}:train:{body.model_seq_id if body.session_id is not None else 0}"
    path = checkpoints.tinker_path(run_id, *source.checkpoint_id.split("/", 1))
    existing = gw.db.get(ModelRow, run_id)
    if existing is not None:
        if (existing.lora_config or {}).get("copied_from") == body.source_path and gw.db.get(CheckpointRow, path):
            return CopyWeightsResponse(tinker_path=path)          # the same request, resent
        raise UserError(f"training run {run_id} already exists; use another model_seq_id")
    path = checkpoints.copy_checkpoint(gw.db, gw.settings.state_dir, source, run_id, session_id, body.ttl_seconds,
                                       owner=caller.user_id, admit=gw.limits.admit_copy(caller, source.size_bytes))
    audit.record(gw.db, "checkpoint_saved", user_id=caller.user_id, org_id=caller.org_id, model_id=run_id,
                 tinker_path=path, copied_from=body.source_path)
    await usage.checkpoint_made(gw.db, path, f"copy:{path}")
    return CopyWeightsResponse(tinker_path=path)


async def _copy_session(gw: Gateway, caller: Caller, body: CopyWeightsRequest, idempotency_key: str) -> str:
    """The session the copy's run is in: the one named (the copy is in its project), else a
    closed session of its own in destination_project_id (Forbidden where the caller is no member)."""
    if body.session_id is not None:
        return (await gw.sessions.session(caller, body.session_id)).session_id
    if not body.destination_project_id:
        raise UserError("copy_weights needs destination_project_id, or session_id and model_seq_id")
    project_id = Projects(gw.db).place(caller, str(body.destination_project_id))
    key = f"{caller.user_id}\0{idempotency_key}"        # one user's key never names another's copy
    session_id = "sess-copy-" + hashlib.sha256(key.encode()).hexdigest()[:12]
    if gw.db.get(SessionRow, session_id) is None:
        gw.db.add(SessionRow(session_id=session_id, owner=caller.user_id, tags=["copy"], finished=True,
                             project_id=project_id))
    return session_id


@router.get("/sessions")
async def list_sessions(page: PageDep, caller: CallerDep, gw: GatewayDep) -> SessionsResponse:
    rows = gw.db.select(select(SessionRow).where(SessionRow.owner == caller.user_id)
                        .order_by(SessionRow.created_at).offset(page.offset).limit(page.limit))
    return SessionsResponse(sessions=[s.session_id for s in rows])


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, caller: CallerDep, gw: GatewayDep) -> SessionResponse:
    row = await gw.sessions.session(caller, session_id)
    runs = gw.db.select(select(ModelRow.model_id).where(ModelRow.session_id == session_id))
    samplers = gw.db.select(select(SamplingSessionRow.sampling_session_id)
                            .where(SamplingSessionRow.session_id == session_id))
    return SessionResponse(training_run_ids=runs, sampler_ids=samplers, user_metadata=row.user_metadata or None,
                           display_name=row.display_name, project_id=row.project_id)
