"""Calls only older SDKs make, kept so that they keep working: `unload_model` (SDK <= 0.25).
(The checkpoint archive download, SDK <= 0.35, is with the other checkpoint routes.)"""

from __future__ import annotations

from fastapi import APIRouter

from gateway import housekeeping
from gateway.auth import CallerDep
from gateway.futures import StoredRequest, fingerprint, json_body, runs
from gateway.protocol import FutureResponse, Id, Request
from gateway.state import Gateway, GatewayDep

router = APIRouter(prefix="/api/v1")


class UnloadModelRequest(Request):
    model_id: Id


@router.post("/unload_model")
async def unload_model(body: UnloadModelRequest, caller: CallerDep, gw: GatewayDep) -> FutureResponse:
    """A future: once the model's queued requests have run, its memory on the trainer is freed.
    Nothing is lost: the model loads again on its next request (as after a lapsed heartbeat)."""
    gw.sessions.model(caller, body.model_id)
    row = gw.futures.submit("unload_model", StoredRequest({"model_id": body.model_id}), owner=caller.user_id,
                            fingerprint=fingerprint("unload_model", body.model_id),
                            admit=gw.limits.admit_queued(caller))
    return FutureResponse(request_id=row.request_id, model_id=body.model_id)


@runs("unload_model")
async def _unload(gw: Gateway, args: dict, body: bytes):
    model_id = args["model_id"]
    await gw.futures.drained(model_id)     # this future has no model_id: it does not wait for itself
    await housekeeping.unload_model(gw, model_id)
    return json_body({"model_id": model_id, "type": "unload_model"})
