"""A model's weights in and out: snapshots for samplers (ephemeral or named), save_state
(adapter + optimizer), external files, and loading a saved state into a model."""

from __future__ import annotations

import datetime
import time
import uuid

from fastapi import APIRouter

from gateway import audit, checkpoints, metrics
from gateway.auth import CallerDep
from gateway.db import CheckpointRow, ModelRow, SamplingSessionRow, now
from gateway.futures import StoredRequest, fingerprint, json_body, runs
from gateway.keys import Caller
from gateway.protocol import FutureResponse, LoadWeightsRequest, SaveWeightsForSamplerRequest, SaveWeightsRequest
from gateway.routes.training import add_run, run_args
from gateway.state import Gateway, GatewayDep, caller_args, stored_caller
from tinkerd.errors import UserError
from tinkerd.v1 import trainer_pb2

router = APIRouter(prefix="/api/v1")


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(body: SaveWeightsForSamplerRequest, caller: CallerDep,
                                   gw: GatewayDep) -> FutureResponse:
    model = gw.sessions.live_model(caller, body.model_id)
    expires_at = checkpoints.expires(body.ttl_seconds)
    # Where the snapshot is recorded once the samplers hold it: a named sampler checkpoint
    # (`path`), or an ephemeral sampling session.
    target = {"caller": caller_args(caller), "session_id": model.session_id, "base_model": model.base_model,
              "path": None, "sampling_session_id": None,
              "expires_at": expires_at.isoformat() if expires_at else None}
    resend = gw.is_resend("save_weights_for_sampler", body.model_id, body.seq_id)
    if body.path is not None:
        name = checkpoints.checkpoint_name(body.path)
        target["path"] = checkpoints.tinker_path(body.model_id, "sampler_weights", name)
        if not resend and gw.db.get(CheckpointRow, target["path"]) is not None:
            raise UserError(f"checkpoint {target['path']} already exists")
    else:
        target["sampling_session_id"] = f"{model.session_id}:sample:{body.sampling_session_seq_id}"
    push = trainer_pb2.PushWeightsRequest(
        model_id=body.model_id, seq_id=body.seq_id, snapshot_id=f"{body.model_id}@{body.seq_id}-{uuid.uuid4().hex[:8]}",
        persist=True, copy_in_background=body.path is None)   # a named checkpoint's files exist when it is listed
    return gw.submit_training(caller, "save_weights_for_sampler", body.model_id, body.seq_id,
                              StoredRequest(target, push.SerializeToString()),
                              # The SDK takes a new sampling_session_seq_id on each try of one request.
                              fingerprint("save_weights_for_sampler",
                                          body.model_dump_json(exclude={"sampling_session_seq_id"})))


@runs("save_weights_for_sampler")
async def _push_weights(gw: Gateway, target: dict, body: bytes):
    push = trainer_pb2.PushWeightsRequest.FromString(body)
    caller, path, sampling_session_id = stored_caller(target["caller"]), target["path"], target["sampling_session_id"]
    # (In the job, not the route: a resend of this very request must still find its future. A
    # session with this very snapshot is this request's own, recorded before a re-drive.)
    existing = sampling_session_id and gw.db.get(SamplingSessionRow, sampling_session_id)
    if existing and existing.snapshot_id != push.snapshot_id:
        raise UserError(f"sampling session {sampling_session_id} exists already: every "
                        f"save_weights_for_sampler needs its own sampling_session_seq_id")
    await gw.backends.samplers.refresh()      # a replica that died since the last check would stall the push
    push.sampler_addresses[:] = gw.backends.samplers.live_addresses()
    t0 = time.perf_counter()
    pushed = await gw.trainer.PushWeights(push)      # a resent (model_id, seq_id) gets the first push's reply
    metrics.pushed(pushed, time.perf_counter() - t0)
    gw.backends.samplers.holds(push.snapshot_id, list(push.sampler_addresses), dict(pushed.transports))
    if path is not None:
        expires_at = target["expires_at"] and datetime.datetime.fromisoformat(target["expires_at"])
        gw.db.put(CheckpointRow(tinker_path=path, model_id=push.model_id, owner=caller.user_id,
                                checkpoint_type="sampler", name=path.rsplit("/", 1)[1],
                                snapshot_id=push.snapshot_id, snapshot_path=pushed.persisted_path,
                                directory=pushed.persisted_path, size_bytes=pushed.num_bytes,
                                expires_at=expires_at or None))
        _audit_saved(gw, caller, push.model_id, path)
    elif not existing and not gw.db.add_if_absent(SamplingSessionRow(
            sampling_session_id=sampling_session_id, owner=caller.user_id, session_id=target["session_id"],
            base_model=target["base_model"], snapshot_id=push.snapshot_id, snapshot_path=pushed.persisted_path,
            snapshot_bytes=pushed.num_bytes)):
        # Another request took this sampling_session_seq_id while the weights were pushed.
        raise UserError(f"sampling session {sampling_session_id} was created meanwhile by another request: every "
                        f"save_weights_for_sampler needs its own sampling_session_seq_id")
    return json_body({"path": path, "sampling_session_id": sampling_session_id,
                      "type": "save_weights_for_sampler"})


def _audit_saved(gw: Gateway, caller: Caller, model_id: str, path: str) -> None:
    audit.record(gw.db, "checkpoint_saved", user_id=caller.user_id, org_id=caller.org_id, model_id=model_id,
                 tinker_path=path)


@router.post("/save_weights")
async def save_weights(body: SaveWeightsRequest, caller: CallerDep, gw: GatewayDep) -> FutureResponse:
    return _save_state(gw, caller, body, "weights", with_optimizer=True, response_type="save_weights")


@router.post("/save_weights_external")
async def save_weights_external(body: SaveWeightsRequest, caller: CallerDep, gw: GatewayDep) -> FutureResponse:
    return _save_state(gw, caller, body, "external_weights", with_optimizer=False,
                       response_type="save_weights_external")


def _save_state(gw: Gateway, caller: Caller, body: SaveWeightsRequest, kind: str, *, with_optimizer: bool,
                response_type: str) -> FutureResponse:
    gw.sessions.live_model(caller, body.model_id)
    name = checkpoints.checkpoint_name(body.path)
    path = checkpoints.tinker_path(body.model_id, kind, name)
    if not gw.is_resend(f"save_{kind}", body.model_id, body.seq_id) and gw.db.get(CheckpointRow, path) is not None \
            and not body.overwrite:
        raise UserError(f"checkpoint {path} already exists (pass overwrite=True to replace it)")
    expires_at = checkpoints.expires(body.ttl_seconds)
    args = {"caller": caller_args(caller), "path": path, "checkpoint_type": checkpoints.KINDS[kind],
            "expires_at": expires_at.isoformat() if expires_at else None, "user_metadata": body.user_metadata,
            "response_type": response_type}
    save = trainer_pb2.SaveStateRequest(model_id=body.model_id, seq_id=body.seq_id, kind=kind, name=name,
                                        with_optimizer=with_optimizer)
    return gw.submit_training(caller, f"save_{kind}", body.model_id, body.seq_id,
                              StoredRequest(args, save.SerializeToString()),
                              fingerprint(f"save_{kind}", body.model_dump_json()))


@runs("save_weights", "save_external_weights")
async def _save(gw: Gateway, args: dict, body: bytes):
    save = trainer_pb2.SaveStateRequest.FromString(body)
    caller, response_type = stored_caller(args["caller"]), args["response_type"]
    row = CheckpointRow(tinker_path=args["path"], model_id=save.model_id, owner=caller.user_id, name=save.name,
                        checkpoint_type=args["checkpoint_type"], user_metadata=args["user_metadata"],
                        expires_at=args["expires_at"] and datetime.datetime.fromisoformat(args["expires_at"]) or None)
    saved = await gw.trainer.SaveState(save)      # a resent (model_id, seq_id) gets the first save's reply
    row.directory, row.size_bytes, row.created_at = saved.directory, saved.size_bytes, now()
    gw.db.put(row)
    _audit_saved(gw, caller, row.model_id, row.tinker_path)
    return json_body({"path": row.tinker_path, "type": response_type})


@router.post("/load_weights")
async def load_weights(body: LoadWeightsRequest, caller: CallerDep, gw: GatewayDep) -> FutureResponse:
    """Create-via-load ({session_id, model_seq_id}) or load into an existing model (legacy). The
    checkpoint is the caller's or a published one."""
    source_run, kind, name = checkpoints.parse_tinker_path(body.path)
    ckpt = gw.sessions.readable_checkpoint(caller, body.path)
    if kind != "weights":
        raise UserError(f"{body.path!r} is not a training checkpoint: load_weights takes a "
                        f"tinker://<run>/weights/<name> path from save_state")
    source = gw.db.get(ModelRow, ckpt.model_id)
    new_run = None
    if body.model_id:
        model_id, seq_id = body.model_id, body.seq_id
        gw.sessions.live_model(caller, model_id)
    else:
        session_id = gw.sessions.open(caller, body.session_id)
        model_id, seq_id = f"{session_id}:train:{body.model_seq_id}", 0
        lora = {k: v for k, v in (source.lora_config or {}).items() if k != "copied_from"}
        new_run = run_args(model_id, session_id, caller.user_id, source.base_model, source.lora_rank, lora)
    create = trainer_pb2.CreateModelRequest(
        model_id=model_id, base_model=gw.settings.base_model, load_optimizer=body.optimizer,
        load_checkpoint=trainer_pb2.CheckpointRef(model_id=source_run, kind=kind, name=name))
    args = {"caller": caller_args(caller), "seq_id": seq_id, "path": body.path, "run": new_run}
    return gw.submit_training(caller, "load_weights", model_id, seq_id, StoredRequest(args, create.SerializeToString()),
                              fingerprint("load_weights", body.model_dump_json()))


@runs("load_weights")
async def _load(gw: Gateway, args: dict, body: bytes):
    create = trainer_pb2.CreateModelRequest.FromString(body)
    seq_id, path = args["seq_id"], args["path"]
    if seq_id > 0:     # legacy: replace the existing model's state
        await gw.trainer.DeleteModel(trainer_pb2.DeleteModelRequest(model_id=create.model_id))
    await gw.trainer.CreateModel(create)
    if args["run"] is not None:
        add_run(gw, stored_caller(args["caller"]), ModelRow(**args["run"]))
    return json_body({"path": path, "model_id": create.model_id, "type": "load_weights"})
