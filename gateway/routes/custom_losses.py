"""create_custom_loss (SDK >= 0.36): a traced loss, checked and stored for the session; its
future answers the loss id that later forward_backward requests name (gateway/custom_losses.py).

The body is at most custom_loss.MAX_REQUEST_BYTES, inflated (gateway/body_limit.py); decoding and
checking it is CPU work, done in the parser thread (gateway/custom_losses.py)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from gateway import custom_losses
from gateway.identity.auth import CallerDep
from gateway.jobs.base import Owner
from gateway.jobs.custom_losses import CreateCustomLoss
from gateway.protocol import FutureResponse
from gateway.state import GatewayDep
from gateway.storage.db import CustomLossRow
from tinkerd.errors import UserError

router = APIRouter(prefix="/api/v1")


@router.post("/create_custom_loss")
async def create_custom_loss(request: Request, caller: CallerDep, gw: GatewayDep) -> FutureResponse:
    """The loss is stored here, counted against its session's and its owner's limits in the same
    transaction; the future then answers its id."""
    body, spec = await custom_losses.parsed(custom_losses.decode, await request.body())
    session_id = await gw.sessions.open(caller, body.session_id)
    loss_id = custom_losses.loss_id_of(session_id, body.custom_loss_seq_id)
    row = CustomLossRow(loss_id=loss_id, session_id=session_id, owner=caller.user_id, name=spec.name,
                        spec_json=spec.canonical, digest=spec.digest)
    existing = await asyncio.to_thread(custom_losses.store, gw.db, row)
    if existing is not None and existing.digest != spec.digest:
        raise UserError(f"custom_loss_seq_id {body.custom_loss_seq_id} of session {session_id} was already used "
                        f"for another loss; every create_custom_loss needs its own custom_loss_seq_id")
    job = CreateCustomLoss(loss_id, session_id, Owner.of(caller), spec.name, "", spec.digest)    # stored above
    row = await gw.jobs.submit(job, caller, fingerprint=spec.digest, idempotency_key=f"{loss_id}#0",
                               admit=gw.limits.admit_queued(caller))     # counted with it, like other queued work
    return FutureResponse(request_id=row.request_id)
