"""Calls only older SDKs make, kept so that they keep working: `unload_model` (SDK <= 0.25).
(The checkpoint archive download, SDK <= 0.35, is with the other checkpoint routes.)"""

from __future__ import annotations

from fastapi import APIRouter

from gateway.jobs.engine import fingerprint
from gateway.identity.auth import CallerDep
from gateway.jobs.service import UnloadModel
from gateway.protocol import FutureResponse, Id, Request
from gateway.state import GatewayDep

router = APIRouter(prefix="/api/v1")


class UnloadModelRequest(Request):
    model_id: Id


@router.post("/unload_model")
async def unload_model(body: UnloadModelRequest, caller: CallerDep, gw: GatewayDep) -> FutureResponse:
    """A future: once the model's queued requests have run, its memory on the trainer is freed.
    Nothing is lost: the model loads again on its next request (as after a lapsed heartbeat)."""
    await gw.sessions.model(caller, body.model_id)
    row = await gw.jobs.submit(UnloadModel(body.model_id), caller,
                               fingerprint=fingerprint("unload_model", body.model_id),
                               admit=gw.limits.admit_queued(caller))
    return FutureResponse(request_id=row.request_id, model_id=body.model_id)
