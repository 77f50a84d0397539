"""create_custom_loss: a checked custom loss stored for its session (gateway/custom_losses.py)."""

from __future__ import annotations

import asyncio
import dataclasses

from gateway import custom_losses
from gateway.jobs.base import Job, Owner, Result, json_body
from gateway.jobs.context import JobContext
from gateway.storage.db import CustomLossRow
from tinkerd.errors import UserError


@dataclasses.dataclass(frozen=True)
class CreateCustomLoss(Job):
    """Answers the loss id of a loss the route stored (routes/custom_losses.py): its `spec_json`
    is then empty, so the future's row does not hold the graph a second time. A future queued
    with its spec_json (by an older gateway) stores the loss here, within the same limits. A
    resend (the same seq_id and graph) finds it stored and answers the same."""
    kinds = ("create_custom_loss",)
    loss_id: str
    session_id: str
    caller: Owner
    name: str
    spec_json: str
    digest: str

    async def run(self, ctx: JobContext) -> Result:
        if self.spec_json:
            row = CustomLossRow(loss_id=self.loss_id, session_id=self.session_id, owner=self.caller.user_id,
                                name=self.name, spec_json=self.spec_json, digest=self.digest)
            stored = await asyncio.to_thread(custom_losses.store, ctx.db, row) or row
        else:
            stored = await asyncio.to_thread(ctx.db.get, CustomLossRow, self.loss_id)
            if stored is None:
                raise UserError(f"custom loss {self.loss_id} is no longer stored: its session was closed")
        if stored.digest != self.digest:
            raise UserError(f"custom_loss_seq_id of {self.loss_id} was already used for another loss; "
                            f"every create_custom_loss needs its own custom_loss_seq_id")
        return json_body({"loss_id": self.loss_id, "type": "create_custom_loss"})
