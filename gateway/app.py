"""The Tinker REST API (as SDK 0.38 speaks it) on top of the Trainer and Sampler gRPC services.

Immediate calls answer from the database; slow calls become futures (gateway/futures.py) whose
jobs call gRPC. Wire conversion lives in gateway/wire.py; state in gateway/db.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import itertools
import json
import logging
import os
import re
import shutil
import uuid

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from sqlalchemy import select

from gateway import wire
from gateway.db import CheckpointRow, Database, ModelRow, SamplingSessionRow, SessionRow, aware, now
from gateway.futures import Futures, json_body
from gateway.registry import (checkpoint_dir, delete_expired_checkpoints, expires, file_routes,
                              parse_tinker_path, registry_routes)
from gateway.stability import StabilityRecords
from tinkerd.errors import NotFoundError, UserError
from tinkerd.paths import dir_name
from tinkerd.rpc import aio_channel
from tinkerd.v1 import common_pb2, sampler_pb2, sampler_pb2_grpc, trainer_pb2, trainer_pb2_grpc

log = logging.getLogger(__name__)

LONG_POLL_S = 25.0          # under the SDK's 45 s read timeout
DEFAULT_MAX_TOKENS = 128
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,255}$")
_Stop = sampler_pb2.SamplingParams.StopMode


@dataclasses.dataclass
class GatewaySettings:
    base_model: str                       # local directory of the base model
    trainer: str                          # host:port
    samplers: list[str]
    state_dir: str
    aliases: list[str] = dataclasses.field(default_factory=list)
    db_url: str | None = None
    # Models of sessions without a heartbeat for this long are unloaded (reloaded on next use).
    session_timeout_s: float = 600.0
    # Sample requests in flight beyond this get HTTP 429: the SDK backs off and resends.
    max_pending_samples: int = 4096
    # Sampled sequences recorded for stable_reinforce are dropped after this long unused.
    stability_ttl_s: float = 3600.0

    @property
    def model_names(self) -> list[str]:
        return [self.base_model, *self.aliases]


class Backends:
    """gRPC stubs; samples go round-robin over the sampler replicas."""

    def __init__(self, settings: GatewaySettings):
        self.trainer = trainer_pb2_grpc.TrainerStub(aio_channel(settings.trainer))
        self.samplers = [sampler_pb2_grpc.SamplerStub(aio_channel(a)) for a in settings.samplers]
        self._next = itertools.cycle(range(len(self.samplers)))

    def sampler(self):
        return self.samplers[next(self._next)]


def _user_error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": message, "category": "user", "detail": message}, status_code=status)


def _future(row, **extra) -> dict:
    return {"request_id": row.request_id, **extra}


def _prompt_tokens(prompt: dict) -> list[int]:
    tokens: list[int] = []
    for chunk in prompt.get("chunks", []):
        if chunk.get("type", "encoded_text") != "encoded_text":
            raise UserError(f"{chunk.get('type')} prompt chunks are not supported by this server (text only)")
        tokens.extend(int(t) for t in chunk.get("tokens", []))
    return tokens


def _sampling_params(p: dict) -> sampler_pb2.SamplingParams:
    out = sampler_pb2.SamplingParams(
        max_tokens=int(p.get("max_tokens") or DEFAULT_MAX_TOKENS), temperature=float(p.get("temperature", 1.0)),
        top_p=float(p.get("top_p", 1.0)), top_k=int(p.get("top_k", -1)))
    if p.get("seed") is not None:
        out.seed = int(p["seed"])
    stop = p.get("stop")
    if stop is None:
        out.stop_mode = _Stop.STOP_MODE_DEFAULT
    elif isinstance(stop, str):
        out.stop_mode, out.stop_strings[:] = _Stop.STOP_MODE_STRINGS, [stop]
    elif len(stop) == 0:
        out.stop_mode = _Stop.STOP_MODE_NONE
    elif all(isinstance(s, str) for s in stop):
        out.stop_mode, out.stop_strings[:] = _Stop.STOP_MODE_STRINGS, stop
    elif all(isinstance(s, int) for s in stop):
        out.stop_mode, out.stop_token_ids[:] = _Stop.STOP_MODE_TOKENS, stop
    else:
        raise UserError("stop must be a string, a list of strings, or a list of token ids")
    return out


def unloaded_dir(settings: GatewaySettings, model_id: str) -> str:
    """Where an unloaded model's state waits for its next use."""
    return os.path.join(settings.state_dir, "unloaded", dir_name(model_id))


async def unload_lapsed_models(db: Database, trainer, settings: GatewaySettings) -> list[str]:
    """Unloads the models of sessions that stopped heart-beating; returns their ids."""
    cutoff = now() - datetime.timedelta(seconds=settings.session_timeout_s)
    unloaded = []
    for model_id in db.models_of_lapsed_sessions(cutoff):
        directory = unloaded_dir(settings, model_id)
        try:
            await trainer.UnloadModel(trainer_pb2.UnloadModelRequest(model_id=model_id, directory=directory))
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:
                log.warning("could not unload %s: %s", model_id, e.details())
                continue
        db.touch(ModelRow, model_id, resident=False)
        unloaded.append(model_id)
    if unloaded:
        log.info("unloaded %d models of lapsed sessions: %s", len(unloaded), unloaded)
    return unloaded


def create_app(settings: GatewaySettings) -> FastAPI:
    os.makedirs(settings.state_dir, exist_ok=True)
    snapshots_dir = os.path.join(settings.state_dir, "snapshots")
    db = Database(settings.db_url or f"sqlite:///{os.path.join(settings.state_dir, 'tinkerd.db')}")
    orphaned = db.fail_orphaned_futures()
    if orphaned:
        log.warning("failed %d futures left pending by a previous run", orphaned)
    state: dict = {}
    # Sessions closed by the client (ServiceClient.close): their models are released and every
    # later call on them is refused. Read on every training/sampling request, so kept in memory.
    finished = set(db.select(select(SessionRow.session_id).where(SessionRow.finished.is_(True))))
    releasing: set[asyncio.Task] = set()
    stability = StabilityRecords(ttl_s=settings.stability_ttl_s)
    app = FastAPI(title="tinkerd gateway")
    app.include_router(registry_routes(db, settings.state_dir))
    app.include_router(file_routes(db))

    @app.on_event("startup")
    async def _startup():
        state["futures"] = Futures(db)
        state["rpc"] = Backends(settings)
        state["reaper"] = asyncio.create_task(reap_forever())

    async def reap_forever():
        interval = min(max(settings.session_timeout_s / 4, 0.5), 30.0)
        while True:
            await asyncio.sleep(interval)
            try:
                await unload_lapsed_models(db, rpc().trainer, settings)
                delete_expired_checkpoints(db)
                stability.expire()
            except Exception:  # noqa: BLE001 - the reaper must outlive one bad pass
                log.exception("housekeeping failed")

    def futures() -> Futures:
        return state["futures"]

    def rpc() -> Backends:
        return state["rpc"]

    @app.exception_handler(UserError)
    async def _on_user_error(request, exc: UserError):
        return _user_error(str(exc), 404 if isinstance(exc, NotFoundError) else 400)

    @app.exception_handler(json.JSONDecodeError)
    async def _on_bad_json(request, exc):
        return _user_error(f"the request body is not valid JSON: {exc}")

    async def body(request: Request) -> dict:
        data = await request.json()
        if not isinstance(data, dict):
            raise UserError("the request body must be a JSON object")
        return data

    def model_row(model_id: str) -> ModelRow:
        row = db.get(ModelRow, model_id or "")
        if row is None:
            raise UserError(f"unknown model_id {model_id!r}: create it with create_model first")
        return row

    def open_session(session_id: str) -> str:
        if db.get(SessionRow, session_id or "") is None:
            raise UserError(f"unknown session_id {session_id!r}")
        if session_id in finished:
            raise UserError(f"session {session_id} was closed (ServiceClient.close); start a new ServiceClient")
        return session_id

    def live_model(model_id: str) -> ModelRow:
        """A model that can still be trained: known, and its session not closed."""
        row = model_row(model_id)
        if row.session_id in finished:
            raise UserError(f"model {model_id} belongs to session {row.session_id}, which was closed "
                            f"(ServiceClient.close); its checkpoints can still be loaded in a new session")
        return row

    async def release_models(session_id: str) -> None:
        """After a session closes: once each model's queued requests have run, free it on the trainer."""
        for model_id in db.select(select(ModelRow.model_id).where(ModelRow.session_id == session_id)):
            await futures().drained(model_id)
            try:
                await rpc().trainer.DeleteModel(trainer_pb2.DeleteModelRequest(model_id=model_id))
            except grpc.aio.AioRpcError as e:
                log.warning("could not release %s: %s", model_id, e.details())
                continue
            futures().forget_runner(model_id)
            shutil.rmtree(unloaded_dir(settings, model_id), ignore_errors=True)
            db.touch(ModelRow, model_id, resident=False)
        log.info("session %s closed; its models are released", session_id)

    # ---- client / service -----------------------------------------------------------------

    @app.post("/api/v1/client/config")
    async def client_config():
        return {"pjwt_auth_enabled": False, "use_pyqwest_transport": False, "proto_compress_fwdbwd": True,
                "parallel_fwdbwd_chunks": True, "sample_use_retrieve_futures": False,
                "custom_loss_server_side": False, "sample_join_sampling_session": False}

    @app.post("/api/v1/client/dynamic_config")
    async def dynamic_config():
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    @app.post("/api/v1/telemetry")
    async def telemetry():
        return {"status": "accepted"}

    @app.get("/api/v1/healthz")
    async def healthz():
        try:
            checks = [rpc().trainer.Health(common_pb2.HealthRequest(), timeout=5)]
            checks += [s.Health(common_pb2.HealthRequest(), timeout=5) for s in rpc().samplers]
            replies = await asyncio.gather(*checks)
        except grpc.aio.AioRpcError as e:
            return JSONResponse({"status": "unavailable", "detail": e.details()}, status_code=503)
        if not all(r.ready for r in replies):
            return JSONResponse({"status": "starting"}, status_code=503)
        return {"status": "ok"}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities():
        return {"supported_models": [{"model_name": name, "trainable": True, "sampleable": True}
                                     for name in settings.model_names]}

    # ---- sessions -------------------------------------------------------------------------

    @app.post("/api/v1/create_session")
    async def create_session(request: Request):
        b = await body(request)
        sid = f"sess-{uuid.uuid4().hex[:12]}"
        db.add(SessionRow(session_id=sid, tags=b.get("tags") or [], user_metadata=b.get("user_metadata") or {}))
        return {"session_id": sid, "type": "create_session"}

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request):
        b = await body(request)
        sid = b.get("session_id", "")
        if sid in finished:    # 410 stops the SDK's heartbeats
            return JSONResponse({"error": f"session {sid} was closed", "category": "user"}, status_code=410)
        if not db.touch(SessionRow, sid, last_heartbeat=now()):
            return JSONResponse({"error": "unknown session", "category": "user"}, status_code=404)
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish_session(session_id: str):
        if session_id in finished:
            return {}
        if not db.touch(SessionRow, session_id, finished=True):
            raise NotFoundError(f"unknown session {session_id!r}")
        finished.add(session_id)
        task = asyncio.create_task(release_models(session_id))
        releasing.add(task)              # held until done: the loop keeps only weak references
        task.add_done_callback(releasing.discard)
        return {}

    # ---- training -------------------------------------------------------------------------

    def submit_training(kind: str, model_id: str, seq_id: int, job, **extra):
        row = futures().submit(kind, job, idempotency_key=f"{model_id}#{seq_id}", model_id=model_id,
                               seq_id=seq_id, extra=extra)
        model = db.get(ModelRow, model_id)
        stamp = now()
        if model is not None and (not model.resident or (stamp - aware(model.last_request_time)).total_seconds() > 5):
            db.touch(ModelRow, model_id, last_request_time=stamp, resident=True)   # at most every 5 s
        return _future(row, model_id=model_id)

    @app.post("/api/v1/create_model")
    async def create_model(request: Request):
        b = await body(request)
        session_id, base = open_session(b.get("session_id")), b.get("base_model")
        if base not in settings.model_names:
            raise UserError(f"base model {base!r} is not supported; this server serves {settings.model_names}")
        lora = b.get("lora_config") or {}
        rank = int(lora.get("rank", 32))
        model_id = f"{session_id}:train:{int(b.get('model_seq_id', 0))}"
        msg = trainer_pb2.CreateModelRequest(model_id=model_id, base_model=settings.base_model,
                                             lora_config=common_pb2.LoraConfig(
                                                 rank=rank, train_attn=lora.get("train_attn", True),
                                                 train_mlp=lora.get("train_mlp", True),
                                                 train_unembed=lora.get("train_unembed", True)))
        if lora.get("seed") is not None:
            msg.lora_config.seed = int(lora["seed"])
        if db.get(ModelRow, model_id) is None:
            db.add(ModelRow(model_id=model_id, session_id=session_id, base_model=base, lora_rank=rank, lora_config=lora))

        async def job():
            await rpc().trainer.CreateModel(msg)
            return json_body({"model_id": model_id, "type": "create_model"})
        return submit_training("create_model", model_id, 0, job)

    @app.post("/api/v1/get_info")
    async def get_info(request: Request):
        row = model_row((await body(request)).get("model_id"))
        return {"type": "get_info", "model_id": row.model_id, "is_lora": True, "lora_rank": row.lora_rank,
                "model_name": row.base_model, "optimizer_config": {"type": "adamw"},
                "model_data": {"arch": "llama", "model_name": row.base_model,
                               "tokenizer_id": os.path.abspath(settings.base_model)}}

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request):
        raw = wire.decompress(await request.body(), request.headers.get("content-encoding"))
        if "json" in request.headers.get("content-type", ""):
            raise UserError("forward_backward expects an application/x-protobuf body (tinker SDK >= 0.30)")
        msg, spans = wire.forward_backward_request(raw)
        model = live_model(msg.model_id)
        if msg.loss_fn == "stable_reinforce" and not msg.forward_only:
            stability.apply(msg, spans, model.session_id)

        async def job():
            reply = await rpc().trainer.ForwardBackward(msg)
            return "application/x-protobuf", wire.forward_backward_output(reply)
        return submit_training("forward" if msg.forward_only else "forward_backward", msg.model_id, msg.seq_id, job)

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request):
        b = await body(request)
        model_id, seq_id = b.get("model_id"), int(b.get("seq_id", 0))
        live_model(model_id)
        p = b.get("adam_params") or b.get("optim_params") or b.get("optimizer_params") or {}
        if p.get("type", "adam") not in ("adam", "adamw"):
            raise UserError(f"optimizer {p.get('type')!r} is not supported; use Adam")
        adam = common_pb2.AdamParams(
            learning_rate=float(p.get("learning_rate", 1e-4)), beta1=float(p.get("beta1", 0.9)),
            beta2=float(p.get("beta2", 0.95)), eps=float(p.get("eps", 1e-12)),
            weight_decay=float(p.get("weight_decay", 0.0)), grad_clip_norm=float(p.get("grad_clip_norm", 0.0)))

        async def job():
            reply = await rpc().trainer.OptimStep(trainer_pb2.OptimStepRequest(model_id=model_id, seq_id=seq_id,
                                                                               adam_params=adam))
            return json_body({"metrics": dict(reply.metrics), "type": "optim_step"})
        return submit_training("optim_step", model_id, seq_id, job)

    def checkpoint_name(b: dict) -> str:
        name = b.get("path")
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise UserError(f"checkpoint name {name!r} must match {_NAME_RE.pattern}")
        return name

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request):
        b = await body(request)
        model_id, seq_id = b.get("model_id"), int(b.get("seq_id", 0))
        model = live_model(model_id)
        name = checkpoint_name(b) if b.get("path") is not None else None
        ttl_expiry = expires(b.get("ttl_seconds"))
        snapshot_id = f"{model_id}@{seq_id}-{uuid.uuid4().hex[:8]}"
        if name is not None:
            tinker_path = f"tinker://{model_id}/sampler_weights/{name}"
            if db.get(CheckpointRow, tinker_path) is not None:
                raise UserError(f"checkpoint {tinker_path} already exists")
            result = {"path": tinker_path, "sampling_session_id": None, "type": "save_weights_for_sampler"}
        else:
            sampling_session_id = f"{model.session_id}:sample:{int(b.get('sampling_session_seq_id', 0))}"
            result = {"path": None, "sampling_session_id": sampling_session_id, "type": "save_weights_for_sampler"}

        async def job():
            pushed = await rpc().trainer.PushWeights(trainer_pb2.PushWeightsRequest(
                model_id=model_id, seq_id=seq_id, snapshot_id=snapshot_id, sampler_addresses=settings.samplers,
                persist_dir=snapshots_dir))
            if name is not None:
                db.add(CheckpointRow(tinker_path=result["path"], model_id=model_id, checkpoint_type="sampler",
                                     name=name, snapshot_id=snapshot_id, snapshot_path=pushed.persisted_path,
                                     directory=pushed.persisted_path, size_bytes=pushed.num_bytes,
                                     expires_at=ttl_expiry))
            else:
                db.add(SamplingSessionRow(sampling_session_id=result["sampling_session_id"],
                                          session_id=model.session_id, base_model=model.base_model,
                                          snapshot_id=snapshot_id, snapshot_path=pushed.persisted_path))
            return json_body(result)
        return submit_training("save_weights_for_sampler", model_id, seq_id, job)

    async def save_files(request: Request, kind: str, with_optimizer: bool, response_type: str):
        """save_weights (adapter + optimizer) and save_weights_external (adapter files to download)."""
        b = await body(request)
        model_id, seq_id = b.get("model_id"), int(b.get("seq_id", 0))
        live_model(model_id)
        name = checkpoint_name(b)
        tinker_path = f"tinker://{model_id}/{kind}/{name}"
        existing = db.get(CheckpointRow, tinker_path)
        if existing is not None and not b.get("overwrite"):
            raise UserError(f"checkpoint {tinker_path} already exists (pass overwrite=True to replace it)")
        ttl_expiry = expires(b.get("ttl_seconds"))
        directory = checkpoint_dir(settings.state_dir, model_id, kind, name)

        async def job():
            saved = await rpc().trainer.SaveState(trainer_pb2.SaveStateRequest(
                model_id=model_id, seq_id=seq_id, directory=directory, with_optimizer=with_optimizer))
            db.put(CheckpointRow(tinker_path=tinker_path, model_id=model_id, name=name, directory=directory,
                                 checkpoint_type="training" if kind == "weights" else "external",
                                 size_bytes=saved.size_bytes, expires_at=ttl_expiry,
                                 user_metadata=b.get("user_metadata") or {}, created_at=now()))
            return json_body({"path": tinker_path, "type": response_type})
        return submit_training(f"save_{kind}", model_id, seq_id, job)

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request):
        return await save_files(request, "weights", with_optimizer=True, response_type="save_weights")

    @app.post("/api/v1/save_weights_external")
    async def save_weights_external(request: Request):
        return await save_files(request, "external_weights", with_optimizer=False,
                                response_type="save_weights_external")

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request):
        """Create-via-load ({session_id, model_seq_id}) or load into an existing model (legacy)."""
        b = await body(request)
        path = b.get("path")
        source_run, kind, _ = parse_tinker_path(path)
        ckpt = db.get(CheckpointRow, path)
        if ckpt is None or kind != "weights":
            raise UserError(f"unknown training checkpoint {path!r}: load_weights takes a "
                            f"tinker://<run>/weights/<name> path from save_state")
        source = model_row(source_run)
        optimizer = bool(b.get("optimizer"))
        if b.get("model_id"):
            model_id, seq_id = b["model_id"], int(b.get("seq_id", 0))
            live_model(model_id)
        else:
            session_id = open_session(b.get("session_id"))
            model_id, seq_id = f"{session_id}:train:{int(b.get('model_seq_id', 0))}", 0
            if db.get(ModelRow, model_id) is None:
                lora = {k: v for k, v in (source.lora_config or {}).items() if k != "copied_from"}
                db.add(ModelRow(model_id=model_id, session_id=session_id, base_model=source.base_model,
                                lora_rank=source.lora_rank, lora_config=lora))
        create = trainer_pb2.CreateModelRequest(model_id=model_id, base_model=settings.base_model,
                                                load_from=ckpt.directory, load_optimizer=optimizer)

        async def job():
            if seq_id > 0:     # legacy: replace the existing model's state
                await rpc().trainer.DeleteModel(trainer_pb2.DeleteModelRequest(model_id=model_id))
            await rpc().trainer.CreateModel(create)
            return json_body({"path": path, "model_id": model_id, "type": "load_weights"})
        return submit_training("load_weights", model_id, seq_id, job)

    # ---- sampling -------------------------------------------------------------------------

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request):
        b = await body(request)
        session_id = open_session(b.get("session_id"))
        sid = f"{session_id}:sample:{int(b.get('sampling_session_seq_id', 0))}"
        path = b.get("model_path")
        if path:
            ckpt = db.get(CheckpointRow, path)
            if ckpt is None or ckpt.checkpoint_type != "sampler":
                raise UserError(f"unknown sampler checkpoint {path!r}")
            base, snapshot, snapshot_path = model_row(ckpt.model_id).base_model, ckpt.snapshot_id, ckpt.snapshot_path
        else:
            base, snapshot, snapshot_path = b.get("base_model"), "", ""
            if base not in settings.model_names:
                raise UserError(f"base model {base!r} is not supported; this server serves {settings.model_names}")
        if db.get(SamplingSessionRow, sid) is None:
            db.add(SamplingSessionRow(sampling_session_id=sid, session_id=session_id, base_model=base,
                                      model_path=path, snapshot_id=snapshot, snapshot_path=snapshot_path))
        return {"sampling_session_id": sid, "type": "create_sampling_session"}

    @app.get("/api/v1/samplers/{sampler_id:path}")
    async def get_sampler(sampler_id: str):
        row = db.get(SamplingSessionRow, sampler_id)
        if row is None:
            raise NotFoundError(f"unknown sampler {sampler_id!r}")
        return {"sampler_id": row.sampling_session_id, "base_model": row.base_model, "model_path": row.model_path}

    @app.post("/api/v1/asample")
    async def asample(request: Request):
        b = await body(request)
        sid = b.get("sampling_session_id") or ""
        session = db.get(SamplingSessionRow, sid)
        if session is None:
            raise UserError(f"unknown sampling_session_id {sid!r}")
        if session.session_id in finished:
            raise UserError(f"sampling session {sid} belongs to session {session.session_id}, which was closed "
                            f"(ServiceClient.close)")
        num_samples = int(b.get("num_samples", 1))
        if not 1 <= num_samples <= 1024:
            raise UserError(f"num_samples must be in 1..1024, got {num_samples}")
        msg = sampler_pb2.SampleRequest(
            snapshot_id=session.snapshot_id, snapshot_path=session.snapshot_path, prompt_tokens=_prompt_tokens(b.get("prompt") or {}),
            num_samples=num_samples, params=_sampling_params(b.get("sampling_params") or {}),
            prompt_logprobs=bool(b.get("prompt_logprobs")), topk_prompt_logprobs=int(b.get("topk_prompt_logprobs") or 0),
            prompt_logprobs_last_n=int(b.get("prompt_logprobs_last_n") or 0),
            topk_sample_logprobs=int(b.get("topk_sample_logprobs") or 0))
        if int(b.get("prompt_alt_tokens_k") or 0) > 0:
            raise UserError("prompt_alt_tokens_k is not supported by this server")

        queued = futures().pending("sample")
        if queued >= settings.max_pending_samples:
            return JSONResponse({"error": f"{queued} sample requests are queued; retry shortly",
                                 "category": "server"}, status_code=429)

        record = bool(b.get("record_stability_info"))

        async def job():
            reply = await rpc().sampler().Sample(msg)
            if record:       # for stable_reinforce, which names these sequences by id
                for i, seq in enumerate(reply.sequences):
                    stability.record(session.session_id, f"{msg.request_id}:{i}", seq.tokens, seq.logprobs)
            return "application/x-protobuf", wire.sample_response(reply)
        row = futures().submit("sample", job, idempotency_key=f"{sid}#{int(b.get('seq_id', 0))}")
        msg.request_id = row.request_id
        return _future(row, sample_sequence_ids=[f"{row.request_id}:{i}" for i in range(num_samples)])

    # ---- futures --------------------------------------------------------------------------

    @app.post("/internal/noop_future")
    async def noop_future():
        """Not Tinker: a future whose job is one trainer Health call (bench/futures.py)."""
        async def job():
            await rpc().trainer.Health(common_pb2.HealthRequest())
            return json_body({"type": "noop"})
        return _future(futures().submit("noop", job))

    async def describe_queue(row) -> tuple[str, str]:
        """Where a pending future is: for training, its place among its model's requests and how
        many other tenants the trainer's fair scheduler is serving."""
        if row.model_id is None:
            return "active", "sampling"
        running, ahead = futures().position(row.model_id, row.request_id)
        try:
            trainer = await rpc().trainer.GetQueueState(trainer_pb2.QueueStateRequest(), timeout=2)
        except grpc.aio.AioRpcError as e:
            return "paused_capacity", f"the trainer is not answering ({e.code().name})"
        others = sum(1 for tenant, n in trainer.queued.items() if n and not row.model_id.startswith(f"{tenant}:"))
        where = "running on the trainer" if running else f"{ahead} earlier request(s) of this model ahead"
        return "active", f"{where}; {others} other tenant(s) waiting for their fair share"

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request):
        request_id = str((await body(request)).get("request_id", ""))
        row = await futures().wait(request_id, LONG_POLL_S)
        if row is None:
            return JSONResponse({"error": f"unknown request_id {request_id!r}", "category": "user"}, status_code=404)
        if row.status == "pending":
            queue_state, reason = await describe_queue(row)
            return JSONResponse({"type": "try_again", "request_id": request_id, "queue_state": queue_state,
                                 "queue_state_reason": reason}, status_code=408)
        return Response(content=row.result, media_type=row.content_type)

    return app
