"""create_custom_loss (SDK >= 0.36): a traced loss, checked and stored for the session; its
future answers the loss id that later forward_backward requests name (gateway/custom_losses.py)."""

from __future__ import annotations

from fastapi import APIRouter

from gateway import custom_losses
from gateway.custom_losses import CreateCustomLossRequest
from gateway.identity.auth import CallerDep
from gateway.jobs.base import Owner
from gateway.jobs.custom_losses import CreateCustomLoss
from gateway.protocol import FutureResponse
from gateway.state import GatewayDep
from gateway.storage.db import CustomLossRow
from tinkerd.errors import UserError

router = APIRouter(prefix="/api/v1")


@router.post("/create_custom_loss")
async def create_custom_loss(body: CreateCustomLossRequest, caller: CallerDep, gw: GatewayDep) -> FutureResponse:
    session_id = gw.sessions.open(caller, body.session_id)
    spec = custom_losses.check(body)
    loss_id = custom_losses.loss_id_of(session_id, body.custom_loss_seq_id)
    existing = gw.db.get(CustomLossRow, loss_id)
    if existing is None:
        custom_losses.check_room(gw.db, session_id)
    elif existing.digest != spec.digest:
        raise UserError(f"custom_loss_seq_id {body.custom_loss_seq_id} of session {session_id} was already used "
                        f"for another loss; every create_custom_loss needs its own custom_loss_seq_id")
    job = CreateCustomLoss(loss_id, session_id, Owner.of(caller), spec.name, spec.canonical, spec.digest)
    row = gw.futures.submit(job, owner=caller.user_id, fingerprint=spec.digest, idempotency_key=f"{loss_id}#0",
                            admit=gw.limits.admit_queued(caller))     # counted with it, like other queued work
    return FutureResponse(request_id=row.request_id)
