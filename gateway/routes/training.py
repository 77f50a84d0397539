"""Training a model: create, get_info, forward_backward (forward), optim_step. Each call that
does work is a future run in the model's seq_id order (gateway/futures.py)."""

from __future__ import annotations

import os

from fastapi import APIRouter, Request

from gateway import audit, convert, metrics, step_metrics
from gateway.auth import CallerDep
from gateway.db import ModelRow
from gateway.futures import StoredRequest, fingerprint, json_body, runs
from gateway.keys import Caller
from gateway.protocol import (CreateModelRequest, FutureResponse, GetInfoResponse, ModelData, ModelIdRequest,
                              OptimStepRequest)
from gateway.state import Gateway, GatewayDep, caller_args, stored_caller
from tinkerd.errors import UserError
from tinkerd.v1 import trainer_pb2

router = APIRouter(prefix="/api/v1")


def supported_base_model(gw: Gateway, name: str | None) -> str:
    if name not in gw.settings.model_names:
        raise UserError(f"base model {name!r} is not supported; this server serves {gw.settings.model_names}")
    return name


@router.post("/create_model")
async def create_model(body: CreateModelRequest, caller: CallerDep, gw: GatewayDep) -> FutureResponse:
    """The run's row is written only once the trainer has made the model: a failed create
    leaves no run behind."""
    session_id = gw.sessions.open(caller, body.session_id)
    base = supported_base_model(gw, body.base_model)
    if body.lora_config.rank > gw.settings.max_lora_rank:
        raise UserError(f"lora_config.rank {body.lora_config.rank} is over this server's --max-lora-rank "
                        f"{gw.settings.max_lora_rank}")
    model_id = f"{session_id}:train:{body.model_seq_id}"      # the model cap is counted as it is queued
    msg = trainer_pb2.CreateModelRequest(model_id=model_id, base_model=gw.settings.base_model,
                                         lora_config=convert.lora_config(body.lora_config))
    run = run_args(model_id, session_id, caller.user_id, base, body.lora_config.rank,
                   body.lora_config.model_dump(exclude_none=True))
    request = StoredRequest({"caller": caller_args(caller), "run": run}, msg.SerializeToString())
    return gw.submit_training(caller, "create_model", model_id, 0, request,
                              fingerprint("create_model", body.model_dump_json()))


@runs("create_model")
async def _create_model(gw: Gateway, args: dict, body: bytes):
    msg = trainer_pb2.CreateModelRequest.FromString(body)
    await gw.trainer.CreateModel(msg)
    add_run(gw, stored_caller(args["caller"]), ModelRow(**args["run"]))
    return json_body({"model_id": msg.model_id, "type": "create_model"})


def run_args(model_id: str, session_id: str, owner: str, base_model: str, lora_rank: int, lora_config: dict) -> dict:
    """A training run's row, as stored request arguments (ModelRow(**run_args(...)))."""
    return {"model_id": model_id, "session_id": session_id, "owner": owner, "base_model": base_model,
            "lora_rank": lora_rank, "lora_config": lora_config}


def add_run(gw: Gateway, caller: Caller, row: ModelRow) -> None:
    """Records a training run the trainer now holds."""
    if gw.db.get(ModelRow, row.model_id) is None:
        gw.db.add(row)
        audit.record(gw.db, "training_run_created", user_id=caller.user_id, org_id=caller.org_id,
                     model_id=row.model_id, base_model=row.base_model, lora_rank=row.lora_rank)


@router.post("/get_info")
async def get_info(body: ModelIdRequest, caller: CallerDep, gw: GatewayDep) -> GetInfoResponse:
    row = gw.sessions.model(caller, body.model_id)
    return GetInfoResponse(model_id=row.model_id, lora_rank=row.lora_rank, model_name=row.base_model,
                           model_data=ModelData(arch="llama", model_name=row.base_model,
                                                tokenizer_id=os.path.abspath(gw.settings.base_model)))


@router.post("/forward_backward")
async def forward_backward(request: Request, caller: CallerDep, gw: GatewayDep) -> FutureResponse:
    """The SDK's protobuf body (maybe zstd); stable_reinforce gets the sampler's recorded logprobs."""
    if "json" in request.headers.get("content-type", ""):
        raise UserError("forward_backward expects an application/x-protobuf body (tinker SDK >= 0.30)")
    raw = convert.decompress(await request.body(), request.headers.get("content-encoding"))
    fb = convert.forward_backward(raw)
    convert.check_forward_backward(fb, convert.model_limits(gw.settings.base_model, gw.settings.max_model_len))
    model = gw.sessions.live_model(caller, fb.model_id)
    if fb.loss_fn == "stable_reinforce" and not fb.forward_only:
        gw.stability.apply(fb, model.session_id)
    kind = "forward" if fb.forward_only else "forward_backward"
    request = StoredRequest({}, convert.trainer_request(fb).SerializeToString())
    return gw.submit_training(caller, kind, fb.model_id, fb.seq_id, request, fingerprint(kind, raw))


@runs("forward", "forward_backward")
async def _forward_backward(gw: Gateway, args: dict, body: bytes):
    msg = trainer_pb2.ForwardBackwardRequest.FromString(body)
    reply = await gw.trainer.ForwardBackward(msg)
    metrics.trained(msg)
    step_metrics.record(gw.db, msg, reply)
    return "application/x-protobuf", convert.forward_backward_output(reply)


@router.post("/optim_step")
async def optim_step(body: OptimStepRequest, caller: CallerDep, gw: GatewayDep) -> FutureResponse:
    gw.sessions.live_model(caller, body.model_id)
    msg = trainer_pb2.OptimStepRequest(model_id=body.model_id, seq_id=body.seq_id,
                                       adam_params=convert.adam_params(body.params))
    return gw.submit_training(caller, "optim_step", body.model_id, body.seq_id,
                              StoredRequest({}, msg.SerializeToString()),
                              fingerprint("optim_step", body.model_dump_json()))


@runs("optim_step")
async def _optim_step(gw: Gateway, args: dict, body: bytes):
    msg = trainer_pb2.OptimStepRequest.FromString(body)
    reply = await gw.trainer.OptimStep(msg)
    step_metrics.record(gw.db, msg, reply)
    return json_body({"metrics": dict(reply.metrics), "type": "optim_step"})
