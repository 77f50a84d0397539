"""The REST registry the SDK's RestClient reads: training runs, their checkpoints (list,
publish, ttl, delete, external file URLs), weights_info, copy_weights, sessions."""

from __future__ import annotations

import datetime
import hashlib
import os
import uuid
from typing import Annotated

from fastapi import APIRouter, Query, Request
from sqlalchemy import select

from gateway import checkpoints
from gateway.db import CheckpointRow, ModelRow, SamplingSessionRow, SessionRow, now
from gateway.protocol import (CheckpointsResponse, CopyWeightsRequest, CopyWeightsResponse, Cursor,
                              ExternalWeightsUrlsResponse, Page, SessionResponse, SessionsResponse, SetTtlRequest,
                              TrainingRun, TrainingRunsResponse, WeightsInfoRequest, WeightsInfoResponse)
from gateway.state import Gateway, GatewayDep
from tinkerd.errors import NotFoundError, UserError

router = APIRouter(prefix="/api/v1")
PageDep = Annotated[Page, Query()]
_CHECKPOINT = "/training_runs/{run_id}/checkpoints/{checkpoint_id:path}"


def _run(gw: Gateway, run_id: str) -> ModelRow:
    row = gw.db.get(ModelRow, run_id)
    if row is None:
        raise NotFoundError(f"unknown training run {run_id!r}")
    return row


def _checkpoint(gw: Gateway, run_id: str, checkpoint_id: str) -> CheckpointRow:
    _run(gw, run_id)
    row = gw.db.get(CheckpointRow, f"tinker://{run_id}/{checkpoint_id}")
    if row is None or row.model_id != run_id:
        raise NotFoundError(f"run {run_id!r} has no checkpoint {checkpoint_id!r}")
    return row


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
async def list_runs(page: PageDep, gw: GatewayDep) -> TrainingRunsResponse:
    stmt = select(ModelRow).order_by(ModelRow.created_at)
    rows = gw.db.select(stmt.offset(page.offset).limit(page.limit))
    return TrainingRunsResponse(training_runs=[checkpoints.run_json(gw.db, r) for r in rows],
                                cursor=Cursor(offset=page.offset, limit=page.limit, total_count=gw.db.count(stmt)))


@router.get("/training_runs/{run_id}")
async def get_run(run_id: str, gw: GatewayDep) -> TrainingRun:
    return checkpoints.run_json(gw.db, _run(gw, run_id))


@router.get("/training_runs/{run_id}/checkpoints")
async def list_run_checkpoints(run_id: str, request: Request, gw: GatewayDep) -> CheckpointsResponse:
    _run(gw, run_id)
    stmt = select(CheckpointRow).where(CheckpointRow.model_id == run_id).order_by(CheckpointRow.created_at)
    rows = gw.db.select(_visible(request, stmt))
    return CheckpointsResponse(checkpoints=[checkpoints.checkpoint_json(c) for c in rows],
                               cursor=Cursor(offset=0, limit=len(rows), total_count=len(rows)))


@router.get("/checkpoints")
async def list_all_checkpoints(request: Request, page: PageDep, gw: GatewayDep) -> CheckpointsResponse:
    stmt = _visible(request, select(CheckpointRow).order_by(CheckpointRow.created_at))
    rows = gw.db.select(stmt.offset(page.offset).limit(page.limit))
    return CheckpointsResponse(checkpoints=[checkpoints.checkpoint_json(c) for c in rows],
                               cursor=Cursor(offset=page.offset, limit=page.limit, total_count=gw.db.count(stmt)))


@router.post(_CHECKPOINT + "/publish")
async def publish(run_id: str, checkpoint_id: str, gw: GatewayDep) -> dict:
    gw.db.touch(CheckpointRow, _checkpoint(gw, run_id, checkpoint_id).tinker_path, public=True)
    return {}


@router.delete(_CHECKPOINT + "/publish")
async def unpublish(run_id: str, checkpoint_id: str, gw: GatewayDep) -> dict:
    gw.db.touch(CheckpointRow, _checkpoint(gw, run_id, checkpoint_id).tinker_path, public=False)
    return {}


@router.put(_CHECKPOINT + "/ttl")
async def set_ttl(run_id: str, checkpoint_id: str, body: SetTtlRequest, gw: GatewayDep) -> dict:
    row = _checkpoint(gw, run_id, checkpoint_id)
    gw.db.touch(CheckpointRow, row.tinker_path, expires_at=checkpoints.expires(body.ttl_seconds))
    return {}


@router.get(_CHECKPOINT + "/external_weights_urls")
async def external_urls(run_id: str, checkpoint_id: str, request: Request, gw: GatewayDep) -> ExternalWeightsUrlsResponse:
    row = _checkpoint(gw, run_id, checkpoint_id)
    if row.checkpoint_type != "external":
        raise UserError(f"{row.tinker_path} is not an external_weights checkpoint")
    base = str(request.base_url).rstrip("/")
    files = sorted(os.path.relpath(os.path.join(root, f), row.directory)
                   for root, _, names in os.walk(row.directory) for f in names)
    return ExternalWeightsUrlsResponse(urls={f: f"{base}/files/{run_id}/{checkpoint_id}/{f}" for f in files},
                                       expires=checkpoints.iso(row.expires_at or now() + datetime.timedelta(days=1)))


@router.delete(_CHECKPOINT)
async def delete(run_id: str, checkpoint_id: str, gw: GatewayDep) -> dict:
    row = _checkpoint(gw, run_id, checkpoint_id)
    gw.db.delete(CheckpointRow, row.tinker_path)
    checkpoints.delete_checkpoint_files(row)
    return {}


@router.post("/weights_info")
async def weights_info(body: WeightsInfoRequest, gw: GatewayDep) -> WeightsInfoResponse:
    run_id, _, _ = checkpoints.parse_tinker_path(body.tinker_path)
    if gw.db.get(CheckpointRow, body.tinker_path) is None:
        raise NotFoundError(f"unknown checkpoint {body.tinker_path!r}")
    run = _run(gw, run_id)
    lora = run.lora_config or {}
    return WeightsInfoResponse(base_model=run.base_model, lora_rank=run.lora_rank,
                               train_unembed=lora.get("train_unembed", True), train_mlp=lora.get("train_mlp", True),
                               train_attn=lora.get("train_attn", True))


@router.post("/copy_weights")
async def copy_weights(body: CopyWeightsRequest, request: Request, gw: GatewayDep) -> CopyWeightsResponse:
    """The run is `{session_id}:train:{model_seq_id}` when the client names its session (SDK
    0.30), else run 0 of a new session for the project, named from the idempotency key so that a
    resent request finds the copy it made."""
    checkpoints.parse_tinker_path(body.source_path)
    source = gw.db.get(CheckpointRow, body.source_path)
    if source is None:
        raise NotFoundError(f"unknown checkpoint {body.source_path!r}")
    _run(gw, source.model_id)
    session_id = _copy_session(gw, body, request.headers.get("x-idempotency-key") or uuid.uuid4().hex)
    run_id = f"{session_id}:train:{body.model_seq_id if body.session_id is not None else 0}"
    path = checkpoints.tinker_path(run_id, *source.checkpoint_id.split("/", 1))
    existing = gw.db.get(ModelRow, run_id)
    if existing is not None:
        if (existing.lora_config or {}).get("copied_from") == body.source_path and gw.db.get(CheckpointRow, path):
            return CopyWeightsResponse(tinker_path=path)          # the same request, resent
        raise UserError(f"training run {run_id} already exists; use another model_seq_id")
    path = checkpoints.copy_checkpoint(gw.db, gw.settings.state_dir, source, run_id, session_id, body.ttl_seconds)
    return CopyWeightsResponse(tinker_path=path)


def _copy_session(gw: Gateway, body: CopyWeightsRequest, idempotency_key: str) -> str:
    if body.session_id is not None:
        if gw.db.get(SessionRow, body.session_id) is None:
            raise UserError(f"unknown session_id {body.session_id!r}")
        return body.session_id
    if not body.destination_project_id:
        raise UserError("copy_weights needs destination_project_id, or session_id and model_seq_id")
    session_id = "sess-copy-" + hashlib.sha256(idempotency_key.encode()).hexdigest()[:12]
    if gw.db.get(SessionRow, session_id) is None:
        gw.db.add(SessionRow(session_id=session_id, tags=["copy"], finished=True,
                             user_metadata={"project_id": str(body.destination_project_id)}))
    return session_id


@router.get("/sessions")
async def list_sessions(page: PageDep, gw: GatewayDep) -> SessionsResponse:
    rows = gw.db.select(select(SessionRow).order_by(SessionRow.created_at).offset(page.offset).limit(page.limit))
    return SessionsResponse(sessions=[s.session_id for s in rows])


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, gw: GatewayDep) -> SessionResponse:
    row = gw.db.get(SessionRow, session_id)
    if row is None:
        raise NotFoundError(f"unknown session {session_id!r}")
    runs = gw.db.select(select(ModelRow.model_id).where(ModelRow.session_id == session_id))
    samplers = gw.db.select(select(SamplingSessionRow.sampling_session_id)
                            .where(SamplingSessionRow.session_id == session_id))
    return SessionResponse(training_run_ids=runs, sampler_ids=samplers, user_metadata=row.user_metadata or None)
