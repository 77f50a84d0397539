"""Server-side custom losses (SDK >= 0.36 `ServiceClient.create_custom_loss`).

create_custom_loss: the SDK uploads its torch.fx-traced per-datum loss as plain data; it is
checked here (tinkerd/custom_loss.py: every node's op against the allowed list, arities, references,
sizes) and stored per session (CustomLossRow) under the loss id "<session_id>:loss:<seq>". A later
forward_backward with loss_fn "custom" and loss_fn_config {"loss_id": ...} (what the SDK's
forward_backward_custom sends for an uploaded LossHandle) carries the stored graph to the trainer,
which builds it once per model and runs it in the same pass (trainer_service/custom_loss.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import delete, select

from gateway.identity.keys import Caller
from gateway.protocol import Id, SeqId
from gateway.storage.db import CustomLossRow
from tinkerd import custom_loss
from tinkerd.errors import NotFoundError, UserError
from tinkerd.v1 import trainer_pb2


class CreateCustomLossRequest(BaseModel):
    """tinker.types.CreateCustomLossRequest; the graph is checked by tinkerd/custom_loss.py, not here."""
    model_config = ConfigDict(extra="ignore")
    session_id: Id
    custom_loss_seq_id: SeqId
    name: str = Field(max_length=custom_loss.MAX_NAME)
    inputs: list[Any] = Field(max_length=custom_loss.MAX_INPUTS)
    graph: dict[str, Any]


def loss_id_of(session_id: str, seq_id: int) -> str:
    return f"{session_id}:loss:{seq_id}"


def check(body: CreateCustomLossRequest) -> custom_loss.LossSpec:
    """The upload, checked (ops, arities, references, sizes, shapes)."""
    return custom_loss.parse(body.name, body.inputs, body.graph)


def check_room(db, session_id: str) -> None:
    """A session stores at most MAX_LOSSES_PER_SESSION losses (each is created once per session)."""
    stored = db.count(select(CustomLossRow.loss_id).where(CustomLossRow.session_id == session_id))
    if stored >= custom_loss.MAX_LOSSES_PER_SESSION:
        raise UserError(f"session {session_id} has created {stored} custom losses, the most one session may "
                        f"({custom_loss.MAX_LOSSES_PER_SESSION}); reuse their LossHandles or start a new session")


def for_forward_backward(db, caller: Caller, session_id: str, loss_id: str | None,
                         data: list) -> trainer_pb2.CustomLoss:
    """The stored loss a forward_backward names (the caller's, of the model's session), after
    checking each datum carries the inputs the loss reads at their declared ranks."""
    if not loss_id:
        raise UserError("loss_fn 'custom' needs loss_fn_config {'loss_id': ...}: create the loss with "
                        "ServiceClient.create_custom_loss and pass its LossHandle to forward_backward_custom")
    row = db.get(CustomLossRow, loss_id)
    if row is None or row.owner != caller.user_id:
        raise NotFoundError(f"unknown custom loss {loss_id!r}: create it with ServiceClient.create_custom_loss")
    if row.session_id != session_id:
        raise UserError(f"custom loss {row.name!r} was created in session {row.session_id}; it can only be used "
                        f"by models of that session")
    spec = custom_loss.from_canonical(row.spec_json)
    for i, datum in enumerate(data):
        _check_datum(spec, i, datum.inputs)
    return trainer_pb2.CustomLoss(loss_id=loss_id, spec_json=row.spec_json)


def _check_datum(spec: custom_loss.LossSpec, i: int, inputs: dict[str, np.ndarray]) -> None:
    for name, rank in spec.inputs[1:]:
        value = inputs.get(name)
        if value is None:
            raise UserError(f"datum {i}: loss_fn_inputs has no {name!r}, which custom loss {spec.name!r} reads")
        # On the wire a rank-0 value is a 1-element tensor of shape [] (sent as [1]).
        actual = 0 if value.size == 1 and rank == 0 else value.ndim
        if actual != rank:
            raise UserError(f"datum {i}: loss_fn_inputs[{name!r}] has shape {list(value.shape)}, but custom loss "
                            f"{spec.name!r} declared {name} with rank {rank}")


def forget_session(db, session_id: str) -> int:
    """A closed session's losses: no model of it can train again, so they go (returns how many)."""
    with db.session() as s:
        deleted = s.execute(delete(CustomLossRow).where(CustomLossRow.session_id == session_id)).rowcount
        s.commit()
    return deleted
