"""create_custom_loss: a checked custom loss stored for its session (gateway/custom_losses.py)."""

from __future__ import annotations

import dataclasses

from gateway.jobs.base import Job, Owner, Result, json_body
from gateway.storage.db import CustomLossRow
from tinkerd.errors import UserError


@dataclasses.dataclass(frozen=True)
class CreateCustomLoss(Job):
    """Stores the loss; a resend (the same seq_id and graph) finds it stored and answers the same."""
    kinds = ("create_custom_loss",)
    loss_id: str
    session_id: str
    caller: Owner
    name: str
    spec_json: str
    digest: str

    async def run(self, gw) -> Result:
        row = CustomLossRow(loss_id=self.loss_id, session_id=self.session_id, owner=self.caller.user_id,
                            name=self.name, spec_json=self.spec_json, digest=self.digest)
        if not gw.db.add_if_absent(row):
            existing = gw.db.get(CustomLossRow, self.loss_id)
            if existing is None or existing.digest != self.digest:
                raise UserError(f"custom_loss_seq_id of {self.loss_id} was already used for another loss; "
                                f"every create_custom_loss needs its own custom_loss_seq_id")
        return json_body({"loss_id": self.loss_id, "type": "create_custom_loss"})
