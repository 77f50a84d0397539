"""Training a model: create, get_info, forward_backward (forward), optim_step. Each call that
does work is a future run in the model's seq_id order (gateway/futures/order.py)."""

from __future__ import annotations


from fastapi import APIRouter, Request

from gateway import bodies, convert, custom_losses
from gateway.jobs.engine import fingerprint
from gateway.identity.auth import CallerDep, caller_of
from gateway.jobs.base import Owner
from gateway.jobs.training import CreateModel, ForwardBackward, NewRun, OptimStep
from gateway.protocol import (CreateModelRequest, FutureResponse, GetInfoResponse, ModelData, ModelIdRequest,
                              OptimStepRequest, optimizer_config)
from gateway.state import GatewayDep, gateway_of
from tinkerd.errors import UserError
from tinkerd.v1 import trainer_pb2

router = APIRouter(prefix="/api/v1")


@router.post("/create_model")
async def create_model(body: CreateModelRequest, caller: CallerDep, gw: GatewayDep) -> FutureResponse:
    """The run's row is written only once the trainer has made the model: a failed create
    leaves no run behind."""
    session_id = await gw.sessions.open(caller, body.session_id)
    base = gw.settings.supported_base_model(body.base_model)
    if body.lora_config.rank > gw.settings.max_lora_rank:
        raise UserError(f"lora_config.rank {body.lora_config.rank} is over this server's --max-lora-rank "
                        f"{gw.settings.max_lora_rank}")
    model_id = f"{session_id}:train:{body.model_seq_id}"      # the model cap is counted as it is queued
    optimizer = body.optimizer_config.type      # fixed for the model's life
    msg = trainer_pb2.CreateModelRequest(model_id=model_id, base_model=gw.settings.base_model,
                                         lora_config=convert.lora_config(body.lora_config),
                                         optimizer=convert.OPTIMIZERS[optimizer])
    run = NewRun(model_id, session_id, caller.user_id, base, body.lora_config.rank,
                 body.lora_config.model_dump(exclude_none=True), optimizer)
    row = await gw.jobs.submit(CreateModel(msg, Owner.of(caller), run), caller, model_id=model_id, seq_id=0,
                               fingerprint=fingerprint("create_model", body.model_dump_json()))
    return FutureResponse(request_id=row.request_id, model_id=model_id)


@router.post("/get_info")
async def get_info(body: ModelIdRequest, caller: CallerDep, gw: GatewayDep) -> GetInfoResponse:
    row = await gw.sessions.model(caller, body.model_id)
    return GetInfoResponse(model_id=row.model_id, lora_rank=row.lora_rank, model_name=row.base_model,
                           optimizer_config=optimizer_config(row.optimizer),
                           # The name the model was made with (an alias, or the directory the client
                           # named): never the server's own path.
                           model_data=ModelData(arch="llama", model_name=row.base_model, tokenizer_id=row.base_model))


@router.post("/forward_backward")
async def forward_backward(request: Request) -> FutureResponse:
    """The SDK's protobuf body (maybe zstd); stable_reinforce gets the sampler's recorded logprobs.
    Hot: called from the edge directly (gateway/edge.py)."""
    caller, gw = caller_of(request), gateway_of(request)
    if "json" in request.headers.get("content-type", ""):
        raise UserError("forward_backward expects an application/x-protobuf body (tinker SDK >= 0.30)")
    raw = await request.body()          # inflated already, if it came zstd (body_limit.py)
    msg = convert.parse_forward_backward(raw)
    model = await gw.sessions.live_model(caller, msg.model_id)     # before any array is made for it
    async with gw.refusing(caller, msg.model_id, msg.seq_id):
        convert.check_cost(msg, convert.Budget.of(gw.settings))   # from shapes: nothing expanded yet
        fb = convert.decode_forward_backward(msg)
        convert.check_forward_backward(fb, convert.model_limits(gw.settings.base_model, gw.settings.max_model_len))
        if fb.loss_fn == "stable_reinforce" and not fb.forward_only:
            await gw.db.run(gw.stability.apply, fb, model.session_id)      # reads the records
        msg = convert.trainer_request(fb)
        if fb.loss_fn == "custom":      # a create_custom_loss graph, run on the trainer by its loss id
            msg.custom_loss.CopyFrom(await custom_losses.for_forward_backward(gw.db, caller, model.session_id,
                                                                              fb.loss_id, fb.data))
    job = ForwardBackward(msg)
    row = await gw.jobs.submit(job, caller, model_id=fb.model_id, seq_id=fb.seq_id,
                               fingerprint=fingerprint(job.kind(), raw))
    return FutureResponse(request_id=row.request_id, model_id=fb.model_id)


@router.post("/optim_step")
async def optim_step(request: Request) -> FutureResponse:
    """Hot: called from the edge directly (gateway/edge.py)."""
    body = await bodies.model_request_of(request, OptimStepRequest)
    caller, gw = caller_of(request), gateway_of(request)
    model = await gw.sessions.live_model(caller, body.model_id)
    async with gw.refusing(caller, body.model_id, body.seq_id):       # the other optimizer's parameters: a 400
        msg = convert.optim_step_request(body.model_id, body.seq_id, body.params, model.optimizer)
    row = await gw.jobs.submit(OptimStep(msg), caller, model_id=body.model_id, seq_id=body.seq_id,
                               fingerprint=fingerprint("optim_step", body.model_dump_json()))
    return FutureResponse(request_id=row.request_id, model_id=body.model_id)
