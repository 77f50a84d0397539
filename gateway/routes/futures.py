"""Futures: retrieve_future long-polls a future's result; a pending one answers try_again with
where it waits. retrieve_futures long-polls a sampling session's finished samples at once (SDK
flag sample_use_retrieve_futures); cancel_future drops a pending sample (dynamic flag
sample_cancel_enabled)."""

from __future__ import annotations

import collections

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from gateway import bodies
from gateway.errors import error_response
from gateway.identity.auth import CallerDep, caller_of
from gateway.jobs.service import Noop
from gateway.storage.db import FutureRow, Status
from gateway.protocol import (CancelFutureRequest, CancelFutureResponse, FutureCompletion, FutureResponse,
                              RetrieveFutureRequest, RetrieveFuturesRequest, RetrieveFuturesResponse,
                              TryAgainResponse, parse_json)
from gateway.state import Gateway, GatewayDep, gateway_of
from tinkerd.errors import NotFoundError
from tinkerd.rpc import user_tenant
from tinkerd.v1 import trainer_pb2

router = APIRouter()

LONG_POLL_S = 25.0          # under the SDK's 45 s read timeout
MAX_COMPLETIONS = 4096      # per retrieve_futures answer; the SDK polls again at once for the rest
GATHER_S = 0.005            # retrieve_futures waits this long after the first completion for more
METADATA_ONLY_BYTES = 4 << 20   # a larger result is announced by its size when the SDK allows it

# Calls served, by route (GET /internal/futures_stats): shows which path clients take.
CALLS: collections.Counter[str] = collections.Counter()


@router.post("/api/v1/retrieve_future")
async def retrieve_future(request: Request):
    """The hottest route (every future polls it): read and checked by hand, and called from the
    edge directly (gateway/edge.py), without FastAPI's layers, whose cost counts on every poll."""
    body = RetrieveFutureRequest.model_validate(await _json(request))
    CALLS["retrieve_future"] += 1
    gw = gateway_of(request)
    row = await gw.futures.waits.wait(body.request_id, LONG_POLL_S, caller_of(request).user_id)
    if row is None:
        return error_response(f"unknown request_id {body.request_id!r}", 404)
    if row.status == Status.PENDING:
        queue_state, reason = await _describe_queue(gw, row, caller_of(request).user_id)
        try_again = TryAgainResponse(request_id=body.request_id, queue_state=queue_state, queue_state_reason=reason)
        return JSONResponse(try_again.model_dump(), status_code=408)
    if body.allow_metadata_only and len(row.result or b"") > METADATA_ONLY_BYTES:
        # Its size first: the SDK reserves that much of its in-flight budget, then asks for it.
        return JSONResponse({"status": "complete_metadata", "response_payload_size": len(row.result)})
    return Response(content=row.result, media_type=row.content_type)


@router.post("/api/v1/retrieve_futures")
async def retrieve_futures(request: Request):
    """The caller's finished samples of one sampling session (and clone) after `prev_cursor`,
    held up to LONG_POLL_S for the first. Another user's sampling session is as unknown as a
    missing one (404). `retrieved_request_ids` are the payloads the client has fetched: each of the
    caller's leaves the queue; an id that is unknown or not the caller's is skipped like one never
    queued, so the answer does not tell them apart."""
    body = await bodies.model_of(request, RetrieveFuturesRequest)      # up to 65,536 ids: off the loop
    CALLS["retrieve_futures"] += 1
    gw = gateway_of(request)
    caller = caller_of(request)
    await gw.sessions.sampling_session(caller, body.target.sampling_session_id)
    target = (body.target.sampling_session_id, body.target.cloned_sampler_id)
    gw.futures.waits.retrieved(body.retrieved_request_ids, caller.user_id)
    timeout = LONG_POLL_S if body.timeout is None else min(body.timeout, LONG_POLL_S)
    found, cursor = await gw.futures.completions.poll(target, body.prev_cursor, timeout, MAX_COMPLETIONS, GATHER_S,
                                                      body.retrieved_request_ids)
    CALLS["completions_reported"] += len(found)
    completions = [FutureCompletion(state="failed", request_id=c.request_id) if c.failed else
                   FutureCompletion(state="finished", request_id=c.request_id,
                                    response_payload_uncompressed_size=c.size) for c in found]
    return RetrieveFuturesResponse(completions=completions, cursor=cursor)


@router.post("/api/v1/cancel_future")
async def cancel_future(body: CancelFutureRequest, caller: CallerDep, gw: GatewayDep) -> CancelFutureResponse:
    """A pending sample is cancelled: its retrieve answers a user error saying so. A finished one
    stays as it is (200, cancelled false: the SDK cancels what it abandons, which may have just
    finished). An unknown id, or another user's, is a 404; a training request a 400."""
    CALLS["cancel_future"] += 1
    outcome = await gw.jobs.cancel(body.request_id, caller.user_id)
    if outcome is None:
        raise NotFoundError(f"unknown request_id {body.request_id!r}")
    CALLS["cancelled"] += outcome.cancelled
    return CancelFutureResponse(request_id=body.request_id, cancelled=outcome.cancelled, status=outcome.status)


@router.get("/internal/futures_stats")
async def futures_stats(caller: CallerDep, gw: GatewayDep) -> dict:
    """Not Tinker: calls served per futures route and completions queued now (admins only:
    counts over all users)."""
    if not caller.admin:
        raise NotFoundError("unknown route /internal/futures_stats")
    return {"calls": dict(CALLS), "completions_queued": await gw.db.run(gw.futures.completions.queued)}


async def _json(request: Request):
    return parse_json(await request.body())


async def _describe_queue(gw: Gateway, row: FutureRow, owner: str) -> tuple[str, str]:
    """Where a pending future is: for training, its place among its model's requests and how
    many other tenants (users; sessions for the trainer's own work) its fair scheduler serves."""
    if row.model_id is None:
        return "active", "sampling"
    running, ahead = gw.jobs.order.position(row.model_id, row.request_id)
    try:
        trainer = await gw.trainer.GetQueueState(trainer_pb2.QueueStateRequest(), timeout=2)
    except grpc.aio.AioRpcError as e:
        return "paused_capacity", f"the trainer is not answering ({e.code().name})"
    others = sum(1 for tenant, n in trainer.queued.items()
                 if n and tenant != user_tenant(owner) and not row.model_id.startswith(f"{tenant}:"))
    where = "running on the trainer" if running else f"{ahead} earlier request(s) of this model ahead"
    return "active", f"{where}; {others} other tenant(s) waiting for their fair share"


@router.post("/internal/noop_future")
async def noop_future(caller: CallerDep, gw: GatewayDep):
    """Not Tinker: a future whose job is one trainer Health call (bench/futures.py). Admins only,
    and in the caller's training queue (--max-queued-per-user): each is a row and a trainer call."""
    if not caller.admin:
        return error_response("/internal/noop_future is for admins (bench/futures.py measures the futures with it)",
                              403)
    row = await gw.jobs.submit(Noop(), caller, admit=gw.limits.admit_queued(caller))
    return FutureResponse(request_id=row.request_id)
