"""Futures: retrieve_future long-polls a future's result; a pending one answers try_again with
where it waits."""

from __future__ import annotations

import functools

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from gateway.auth import CallerDep, caller_of
from gateway.db import FutureRow
from gateway.errors import error_response
from gateway.futures import json_body
from gateway.protocol import FutureResponse, RetrieveFutureRequest, TryAgainResponse, parse_json
from gateway.state import Gateway, GatewayDep, gateway_of
from tinkerd.v1 import common_pb2, trainer_pb2

router = APIRouter()

LONG_POLL_S = 25.0          # under the SDK's 45 s read timeout


@router.post("/api/v1/retrieve_future")
async def retrieve_future(request: Request):
    """The hottest route (every future polls it): read and checked by hand, without the
    dependency and body machinery, which cost ~0.5 ms a request on a 2-core VM."""
    body = RetrieveFutureRequest.model_validate(await _json(request))
    gw = gateway_of(request)
    row = await gw.futures.wait(body.request_id, LONG_POLL_S, caller_of(request).user_id)
    if row is None:
        return error_response(f"unknown request_id {body.request_id!r}", 404)
    if row.status == "pending":
        queue_state, reason = await _describe_queue(gw, row)
        try_again = TryAgainResponse(request_id=body.request_id, queue_state=queue_state, queue_state_reason=reason)
        return JSONResponse(try_again.model_dump(), status_code=408)
    return Response(content=row.result, media_type=row.content_type)


async def _json(request: Request):
    return parse_json(await request.body())


async def _describe_queue(gw: Gateway, row: FutureRow) -> tuple[str, str]:
    """Where a pending future is: for training, its place among its model's requests and how
    many other tenants the trainer's fair scheduler is serving."""
    if row.model_id is None:
        return "active", "sampling"
    running, ahead = gw.futures.position(row.model_id, row.request_id)
    try:
        trainer = await gw.trainer.GetQueueState(trainer_pb2.QueueStateRequest(), timeout=2)
    except grpc.aio.AioRpcError as e:
        return "paused_capacity", f"the trainer is not answering ({e.code().name})"
    others = sum(1 for tenant, n in trainer.queued.items() if n and not row.model_id.startswith(f"{tenant}:"))
    where = "running on the trainer" if running else f"{ahead} earlier request(s) of this model ahead"
    return "active", f"{where}; {others} other tenant(s) waiting for their fair share"


@router.post("/internal/noop_future")
async def noop_future(caller: CallerDep, gw: GatewayDep) -> FutureResponse:
    """Not Tinker: a future whose job is one trainer Health call (bench/futures.py)."""
    row = gw.futures.submit("noop", functools.partial(_noop, gw), owner=caller.user_id)
    return FutureResponse(request_id=row.request_id)


async def _noop(gw: Gateway):
    await gw.trainer.Health(common_pb2.HealthRequest())
    return json_body({"type": "noop"})
