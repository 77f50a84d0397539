"""A model's weights in and out: snapshots for samplers (ephemeral or named), save_state
(adapter + optimizer), external files, and loading a saved state into a model."""

from __future__ import annotations

import uuid

from fastapi import APIRouter

from gateway import access_tokens, checkpoints, convert
from gateway.errors import error_response
from gateway.jobs.engine import fingerprint
from gateway.identity.auth import CallerDep
from gateway.identity.caller import Caller
from gateway.jobs.base import Owner
from gateway.jobs.training import NewRun
from gateway.jobs.weights import LoadWeights, PushWeights, SaveState
from gateway.protocol import FutureResponse, LoadWeightsRequest, SaveWeightsForSamplerRequest, SaveWeightsRequest
from gateway.state import Gateway, GatewayDep
from gateway.storage.db import CheckpointRow, ModelRow
from tinkerd import age
from tinkerd.errors import UserError
from tinkerd.optimizers import ADAMW
from tinkerd.v1 import trainer_pb2

router = APIRouter(prefix="/api/v1")


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(body: SaveWeightsForSamplerRequest, caller: CallerDep,
                                   gw: GatewayDep) -> FutureResponse:
    model = await gw.sessions.live_model(caller, body.model_id)
    # Where the snapshot is recorded once the samplers hold it: a named sampler checkpoint
    # (`path`), or an ephemeral sampling session.
    path = sampling_session_id = None
    async with gw.refusing(caller, body.model_id, body.seq_id):
        expires_at = checkpoints.expires(body.ttl_seconds)
        if body.path is not None:
            path = checkpoints.tinker_path(body.model_id, "sampler_weights", checkpoints.checkpoint_name(body.path))
            # (A resend is asked only of a name taken: a read the first send of a save never needs.)
            if await gw.db.row(CheckpointRow, path) is not None \
                    and not await gw.is_resend("save_weights_for_sampler", body.model_id, body.seq_id):
                raise UserError(f"checkpoint {path} already exists")
        else:
            sampling_session_id = f"{model.session_id}:sample:{body.sampling_session_seq_id}"
        if body.kind == "inflight" and body.path is not None:
            raise UserError("kind 'inflight' is for a sampling client's save "
                            "(save_weights_and_get_sampling_client), not a named checkpoint's (path)")
    push = trainer_pb2.PushWeightsRequest(
        model_id=body.model_id, seq_id=body.seq_id, snapshot_id=f"{body.model_id}@{body.seq_id}-{uuid.uuid4().hex[:8]}",
        # A named checkpoint's files exist when it is listed; an inflight save's once it is the target.
        persist=True, copy_in_background=body.path is None and body.kind != "inflight")
    job = PushWeights(push, Owner.of(caller), model.session_id, model.base_model, path, sampling_session_id,
                      expires_at.isoformat() if expires_at else None, body.kind == "inflight")
    # The SDK takes a new sampling_session_seq_id on each try of one request.
    same = fingerprint("save_weights_for_sampler", body.model_dump_json(exclude={"sampling_session_seq_id"}))
    row = await gw.jobs.submit(job, caller, model_id=body.model_id, seq_id=body.seq_id, fingerprint=same)
    return FutureResponse(request_id=row.request_id, model_id=body.model_id)


@router.post("/save_weights")
async def save_weights(body: SaveWeightsRequest, caller: CallerDep, gw: GatewayDep) -> FutureResponse:
    return await _save_state(gw, caller, body, "weights", with_optimizer=True, response_type="save_weights")


@router.post("/save_weights_external")
async def save_weights_external(body: SaveWeightsRequest, caller: CallerDep, gw: GatewayDep) -> FutureResponse:
    return await _save_state(gw, caller, body, "external_weights", with_optimizer=False,
                       response_type="save_weights_external")


async def _save_state(gw: Gateway, caller: Caller, body: SaveWeightsRequest, kind: str, *, with_optimizer: bool,
                response_type: str) -> FutureResponse:
    await gw.sessions.live_model(caller, body.model_id)
    async with gw.refusing(caller, body.model_id, body.seq_id):
        name = checkpoints.checkpoint_name(body.path)
        path = checkpoints.tinker_path(body.model_id, kind, name)
        if not body.overwrite and await gw.db.row(CheckpointRow, path) is not None \
                and not await gw.is_resend(f"save_{kind}", body.model_id, body.seq_id):
            raise UserError(f"checkpoint {path} already exists (pass overwrite=True to replace it)")
        expires_at = checkpoints.expires(body.ttl_seconds)
        recipients = body.age_encryption_recipients or []
        if recipients and kind != "external_weights":
            raise UserError("age_encryption_recipients: only save_weights_external encrypts its files")
        age.recipients(recipients)          # each parses, before anything is queued
    save = trainer_pb2.SaveStateRequest(model_id=body.model_id, seq_id=body.seq_id, kind=kind, name=name,
                                        with_optimizer=with_optimizer, age_recipients=recipients)
    job = SaveState(save, Owner.of(caller), path, checkpoints.KINDS[kind],
                    expires_at.isoformat() if expires_at else None, body.user_metadata, response_type)
    row = await gw.jobs.submit(job, caller, model_id=body.model_id, seq_id=body.seq_id,
                               fingerprint=fingerprint(job.kind(), body.model_dump_json()))
    return FutureResponse(request_id=row.request_id, model_id=body.model_id)


@router.post("/load_weights")
async def load_weights(body: LoadWeightsRequest, caller: CallerDep, gw: GatewayDep) -> FutureResponse:
    """Create-via-load ({session_id, model_seq_id}) or load into an existing model (legacy). The
    checkpoint is the caller's, a published one, or one its owner granted by weights_access_token."""
    source_run, kind, name = checkpoints.parse_tinker_path(body.path)
    try:
        ckpt = await access_tokens.readable(gw.db, gw.sessions, caller, body.path, body.weights_access_token,
                                      "load_weights")
    except access_tokens.TokenRefused as e:
        return error_response(str(e), 403)
    if kind != "weights":
        raise UserError(f"{body.path!r} is not a training checkpoint: load_weights takes a "
                        f"tinker://<run>/weights/<name> path from save_state")
    source = gw.db.get(ModelRow, ckpt.model_id)
    new_run = None
    if body.model_id:
        model_id, seq_id = body.model_id, body.seq_id
        optimizer = (await gw.sessions.live_model(caller, model_id)).optimizer     # an existing model keeps its own
        async with gw.refusing(caller, model_id, seq_id):
            _check_optimizer(body, source.optimizer, optimizer,
                             f"model {model_id} was created with the {optimizer} optimizer")
    else:
        session_id = await gw.sessions.open(caller, body.session_id)
        model_id, seq_id = f"{session_id}:train:{body.model_seq_id}", 0
        requested = body.optimizer_config.type if body.optimizer_config else ADAMW
        optimizer = source.optimizer if body.optimizer else requested
        _check_optimizer(body, source.optimizer, requested, "")
        lora = {k: v for k, v in (source.lora_config or {}).items() if k != "copied_from"}
        new_run = NewRun(model_id, session_id, caller.user_id, source.base_model, source.lora_rank, lora,
                         optimizer)
    create = trainer_pb2.CreateModelRequest(
        model_id=model_id, base_model=gw.settings.base_model, load_optimizer=body.optimizer,
        load_checkpoint=trainer_pb2.CheckpointRef(model_id=source_run, kind=kind, name=name),
        optimizer=convert.OPTIMIZERS[optimizer], after_seq_id=seq_id)
    row = await gw.jobs.submit(LoadWeights(create, Owner.of(caller), seq_id, body.path, new_run), caller,
                               model_id=model_id, seq_id=seq_id,
                               fingerprint=fingerprint("load_weights", body.model_dump_json()))
    return FutureResponse(request_id=row.request_id, model_id=model_id)


def _check_optimizer(body: LoadWeightsRequest, saved: str, wanted: str, existing: str) -> None:
    """A model's optimizer is fixed: restored optimizer state is the checkpoint's optimizer's
    (`saved`), and an `existing` model (its description; "" for a new one) keeps its own."""
    if body.optimizer and body.optimizer_config and body.optimizer_config.type != saved:
        raise UserError(f"{body.path} holds {saved} optimizer state; optimizer_config "
                        f"{body.optimizer_config.type!r} cannot override it: load it without optimizer state")
    if existing and body.optimizer_config and body.optimizer_config.type != wanted:
        raise UserError(f"{existing}; optimizer_config {body.optimizer_config.type!r} cannot change it")
    if existing and body.optimizer and saved != wanted:
        raise UserError(f"{existing}; {body.path} holds {saved} optimizer state: load it without optimizer state")
