"""The REST registry of training runs, checkpoints and sessions (RestClient in the SDK).

A training run is a model (`{session_id}:train:{n}`); its checkpoints are rows of the database
with their files on disk: `weights/<name>` (PEFT adapter + optimizer state, from save_state),
`sampler_weights/<name>` (the adapter a sampler serves), `external_weights/<name>` (files the
gateway serves over plain GET). Checkpoint ids contain a slash, run ids colons.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import os
import shutil
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse
from sqlalchemy import select

from gateway.db import CheckpointRow, Database, ModelRow, SamplingSessionRow, SessionRow, aware, now
from tinkerd.errors import NotFoundError, UserError
from tinkerd.paths import dir_name

log = logging.getLogger(__name__)

_KINDS = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}


def _iso(t: datetime.datetime | None) -> str | None:
    if t is None:
        return None
    return aware(t).isoformat()


def checkpoint_json(row: CheckpointRow) -> dict:
    return {"checkpoint_id": row.checkpoint_id, "checkpoint_type": row.checkpoint_type, "time": _iso(row.created_at),
            "tinker_path": row.tinker_path, "size_bytes": row.size_bytes, "public": bool(row.public),
            "user_metadata": row.user_metadata or None, "expires_at": _iso(row.expires_at)}


def parse_tinker_path(path: str) -> tuple[str, str, str]:
    """tinker://<run>/<kind>/<name> -> (run, kind, name); a user error if it is not one."""
    if not isinstance(path, str) or not path.startswith("tinker://"):
        raise UserError(f"{path!r} is not a tinker:// path")
    parts = path[len("tinker://"):].split("/")
    if len(parts) != 3 or parts[1] not in _KINDS or not parts[0] or not parts[2]:
        raise UserError(f"{path!r} is not a checkpoint path (tinker://<run>/<weights|sampler_weights|"
                        f"external_weights>/<name>)")
    return parts[0], parts[1], parts[2]


def expires(ttl_seconds) -> datetime.datetime | None:
    if ttl_seconds is None:
        return None
    ttl = int(ttl_seconds)
    if ttl <= 0:
        raise UserError(f"ttl_seconds must be positive, got {ttl}")
    return now() + datetime.timedelta(seconds=ttl)


def _knows_external(request: Request) -> bool:
    """SDKs before 0.28 have checkpoint_type "training" | "sampler" only and fail to parse a
    list holding an external one; they cannot make one either, so their lists leave them out."""
    try:
        version = tuple(int(p) for p in request.headers.get("x-stainless-package-version", "").split(".")[:2])
    except ValueError:
        return True
    return len(version) < 2 or version >= (0, 28)


def _page(request: Request) -> tuple[int, int]:
    try:
        limit = int(request.query_params.get("limit", 100))
        offset = int(request.query_params.get("offset", 0))
    except ValueError:
        raise UserError("limit and offset must be integers") from None
    if not (1 <= limit <= 10_000 and offset >= 0):
        raise UserError("limit must be in 1..10000 and offset >= 0")
    return limit, offset


def checkpoint_dir(state_dir: str, model_id: str, kind: str, name: str) -> str:
    return os.path.join(state_dir, "checkpoints", dir_name(model_id), kind, name)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)            # shares the bytes; deleting either side leaves the other intact
    except OSError:
        shutil.copy2(src, dst)       # another filesystem


def delete_checkpoint_files(row: CheckpointRow) -> None:
    for path in {row.directory, row.snapshot_path} - {""}:
        shutil.rmtree(path, ignore_errors=True)


def delete_expired_checkpoints(db: Database) -> int:
    """Checkpoints past their ttl: rows and files go. Run by the gateway's housekeeping loop."""
    expired = db.select(select(CheckpointRow).where(CheckpointRow.expires_at.is_not(None),
                                                    CheckpointRow.expires_at < now()))
    for row in expired:
        db.delete(CheckpointRow, row.tinker_path)
        delete_checkpoint_files(row)
        log.info("deleted expired checkpoint %s", row.tinker_path)
    return len(expired)


def registry_routes(db: Database, state_dir: str) -> APIRouter:
    r = APIRouter(prefix="/api/v1")

    def run_row(run_id: str) -> ModelRow:
        row = db.get(ModelRow, run_id)
        if row is None:
            raise NotFoundError(f"unknown training run {run_id!r}")
        return row

    def checkpoint_row(run_id: str, checkpoint_id: str) -> CheckpointRow:
        run_row(run_id)
        row = db.get(CheckpointRow, f"tinker://{run_id}/{checkpoint_id}")
        if row is None or row.model_id != run_id:
            raise NotFoundError(f"run {run_id!r} has no checkpoint {checkpoint_id!r}")
        return row

    def last_checkpoint(run_id: str, kind: str) -> dict | None:
        rows = db.select(select(CheckpointRow).where(CheckpointRow.model_id == run_id,
                                                     CheckpointRow.checkpoint_type == kind)
                         .order_by(CheckpointRow.created_at.desc()).limit(1))
        return checkpoint_json(rows[0]) if rows else None

    def run_json(row: ModelRow) -> dict:
        return {"training_run_id": row.model_id, "base_model": row.base_model, "model_owner": row.session_id,
                "is_lora": True, "corrupted": False, "lora_rank": row.lora_rank,
                "last_request_time": _iso(row.last_request_time),
                "last_checkpoint": last_checkpoint(row.model_id, "training"),
                "last_sampler_checkpoint": last_checkpoint(row.model_id, "sampler"), "user_metadata": None}

    def paged(request: Request, stmt, key: str, to_json) -> dict:
        limit, offset = _page(request)
        rows = db.select(stmt.offset(offset).limit(limit))
        return {key: [to_json(row) for row in rows],
                "cursor": {"offset": offset, "limit": limit, "total_count": db.count(stmt)}}

    @r.get("/training_runs")
    async def list_runs(request: Request):
        return paged(request, select(ModelRow).order_by(ModelRow.created_at), "training_runs", run_json)

    @r.get("/training_runs/{run_id}")
    async def get_run(run_id: str):
        return run_json(run_row(run_id))

    def visible(request: Request, stmt):
        return stmt if _knows_external(request) else stmt.where(CheckpointRow.checkpoint_type != "external")

    @r.get("/training_runs/{run_id}/checkpoints")
    async def list_run_checkpoints(run_id: str, request: Request):
        run_row(run_id)
        rows = db.select(visible(request, select(CheckpointRow).where(CheckpointRow.model_id == run_id)
                                 .order_by(CheckpointRow.created_at)))
        return {"checkpoints": [checkpoint_json(c) for c in rows],
                "cursor": {"offset": 0, "limit": len(rows), "total_count": len(rows)}}

    @r.get("/checkpoints")
    async def list_all_checkpoints(request: Request):
        return paged(request, visible(request, select(CheckpointRow).order_by(CheckpointRow.created_at)),
                     "checkpoints", checkpoint_json)

    @r.post("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/publish")
    async def publish(run_id: str, checkpoint_id: str):
        db.touch(CheckpointRow, checkpoint_row(run_id, checkpoint_id).tinker_path, public=True)
        return {}

    @r.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/publish")
    async def unpublish(run_id: str, checkpoint_id: str):
        db.touch(CheckpointRow, checkpoint_row(run_id, checkpoint_id).tinker_path, public=False)
        return {}

    @r.put("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/ttl")
    async def set_ttl(run_id: str, checkpoint_id: str, request: Request):
        row = checkpoint_row(run_id, checkpoint_id)
        data = await request.json()
        db.touch(CheckpointRow, row.tinker_path, expires_at=expires((data or {}).get("ttl_seconds")))
        return {}

    @r.get("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/external_weights_urls")
    async def external_urls(run_id: str, checkpoint_id: str, request: Request):
        row = checkpoint_row(run_id, checkpoint_id)
        if row.checkpoint_type != "external":
            raise UserError(f"{row.tinker_path} is not an external_weights checkpoint")
        base = str(request.base_url).rstrip("/")
        files = sorted(os.path.relpath(os.path.join(root, f), row.directory)
                       for root, _, names in os.walk(row.directory) for f in names)
        return {"urls": {f: f"{base}/files/{run_id}/{checkpoint_id}/{f}" for f in files},
                "expires": _iso(row.expires_at or now() + datetime.timedelta(days=1))}

    @r.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
    async def delete(run_id: str, checkpoint_id: str):
        row = checkpoint_row(run_id, checkpoint_id)
        db.delete(CheckpointRow, row.tinker_path)
        delete_checkpoint_files(row)
        return {}

    @r.post("/weights_info")
    async def weights_info(request: Request):
        path = (await request.json() or {}).get("tinker_path")
        run_id, _, _ = parse_tinker_path(path)
        row = db.get(CheckpointRow, path)
        if row is None:
            raise NotFoundError(f"unknown checkpoint {path!r}")
        run = run_row(run_id)
        lora = run.lora_config or {}
        return {"base_model": run.base_model, "is_lora": True, "lora_rank": run.lora_rank,
                "train_unembed": lora.get("train_unembed", True), "train_mlp": lora.get("train_mlp", True),
                "train_attn": lora.get("train_attn", True)}

    @r.post("/copy_weights")
    async def copy_weights(request: Request):
        """A copy of a checkpoint in a new training run that cannot be trained on (it has no model
        on the trainer). Files are hard links. The run is `{session_id}:train:{model_seq_id}` when
        the client names its session (SDK 0.30), else run 0 of a new session for the project."""
        b = await request.json()
        if not isinstance(b, dict):
            raise UserError("the request body must be a JSON object")
        source_path = b.get("source_path")
        parse_tinker_path(source_path)
        source = db.get(CheckpointRow, source_path)
        if source is None:
            raise NotFoundError(f"unknown checkpoint {source_path!r}")
        source_run = run_row(source.model_id)
        key = request.headers.get("x-idempotency-key") or uuid.uuid4().hex
        if b.get("session_id") is not None:
            session_id = b["session_id"]
            if db.get(SessionRow, session_id) is None:
                raise UserError(f"unknown session_id {session_id!r}")
            run_id = f"{session_id}:train:{int(b.get('model_seq_id') or 0)}"
        elif b.get("destination_project_id"):
            session_id = "sess-copy-" + hashlib.sha256(key.encode()).hexdigest()[:12]   # a retry finds it
            run_id = f"{session_id}:train:0"
            if db.get(SessionRow, session_id) is None:
                db.add(SessionRow(session_id=session_id, tags=["copy"], finished=True,
                                  user_metadata={"project_id": str(b["destination_project_id"])}))
        else:
            raise UserError("copy_weights needs destination_project_id, or session_id and model_seq_id")
        tinker_path = f"tinker://{run_id}/{source.checkpoint_id}"
        existing = db.get(ModelRow, run_id)
        if existing is not None:
            if (existing.lora_config or {}).get("copied_from") == source_path and db.get(CheckpointRow, tinker_path):
                return {"tinker_path": tinker_path}           # the same request, resent
            raise UserError(f"training run {run_id} already exists; use another model_seq_id")
        kind, name = source.checkpoint_id.split("/", 1)
        directory = checkpoint_dir(state_dir, run_id, kind, name)
        shutil.rmtree(directory, ignore_errors=True)
        shutil.copytree(source.directory, directory, copy_function=_link_or_copy)
        db.add(ModelRow(model_id=run_id, session_id=session_id, base_model=source_run.base_model,
                        lora_rank=source_run.lora_rank, resident=False,
                        lora_config={**(source_run.lora_config or {}), "copied_from": source_path}))
        db.add(CheckpointRow(tinker_path=tinker_path, model_id=run_id, checkpoint_type=source.checkpoint_type,
                             name=name, snapshot_id=source.snapshot_id,
                             snapshot_path=directory if source.snapshot_path else "", directory=directory,
                             size_bytes=source.size_bytes, expires_at=expires(b.get("ttl_seconds"))))
        log.info("copied %s to %s", source_path, tinker_path)
        return {"tinker_path": tinker_path}

    @r.get("/sessions")
    async def list_sessions(request: Request):
        limit, offset = _page(request)
        rows = db.select(select(SessionRow).order_by(SessionRow.created_at).offset(offset).limit(limit))
        return {"sessions": [s.session_id for s in rows]}

    @r.get("/sessions/{session_id}")
    async def get_session(session_id: str):
        row = db.get(SessionRow, session_id)
        if row is None:
            raise NotFoundError(f"unknown session {session_id!r}")
        runs = db.select(select(ModelRow.model_id).where(ModelRow.session_id == session_id))
        samplers = db.select(select(SamplingSessionRow.sampling_session_id)
                             .where(SamplingSessionRow.session_id == session_id))
        return {"training_run_ids": runs, "sampler_ids": samplers, "user_metadata": row.user_metadata or None}

    return r


def file_routes(db: Database) -> APIRouter:
    """Plain GETs for external_weights files (the CLI downloads them without auth headers)."""
    r = APIRouter()

    @r.get("/files/{run_id}/external_weights/{name}/{relative:path}")
    async def get_file(run_id: str, name: str, relative: str):
        row = db.get(CheckpointRow, f"tinker://{run_id}/external_weights/{name}")
        if row is None:
            raise NotFoundError("unknown checkpoint")
        path = os.path.realpath(os.path.join(row.directory, relative))
        if not path.startswith(os.path.realpath(row.directory) + os.sep) or not os.path.isfile(path):
            raise NotFoundError(f"no file {relative!r} in {row.tinker_path}")
        return FileResponse(path)

    return r
