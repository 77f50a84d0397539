"""Server-side custom losses (SDK >= 0.36 `ServiceClient.create_custom_loss`).

create_custom_loss: the SDK uploads its torch.fx-traced per-datum loss as plain data; it is
checked here (tinkerd/custom_loss.py: every node's op against the allowed list, arities, references,
sizes) and stored per session (CustomLossRow) under the loss id "<session_id>:loss:<seq>". A later
forward_backward with loss_fn "custom" and loss_fn_config {"loss_id": ...} (what the SDK's
forward_backward_custom sends for an uploaded LossHandle) carries the stored graph to the trainer,
which builds it once per model and runs it in the same pass (trainer_service/custom_loss.py).

Parsing a graph is CPU work: it runs in one thread of its own (`parsed`), one graph at a time (a
second thread would only take the GIL from the event loop more often), and what forward_backward
needs of a stored spec (its inputs and their ranks) is kept by the spec's digest, so a loss is
parsed once per gateway, not once per request. What a user stores is counted in the transaction that stores it
(a session's loss count, the user's bytes): a burst of creates cannot pass either limit.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import hashlib
import threading
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import delete, func, select
from sqlalchemy.engine import Connection

from gateway.identity.caller import Caller
from gateway.protocol import Id, SeqId
from gateway.storage.db import CustomLossRow, SessionRow
from tinkerd import custom_loss
from tinkerd.errors import NotFoundError, UserError
from tinkerd.v1 import trainer_pb2

# The stored losses (canonical JSON) of one user, over all their sessions: 128 of the largest
# graph, thousands of ordinary ones.
MAX_BYTES_PER_USER = 32 << 20

_LOSSES = CustomLossRow.__table__.c
_PARSER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="custom-loss-parse")


async def parsed(fn, *args):
    """fn(*args) in the parser thread: decode, or _SPECS.parse."""
    return await asyncio.get_running_loop().run_in_executor(_PARSER, fn, *args)


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


def decode(raw: bytes) -> tuple[CreateCustomLossRequest, custom_loss.LossSpec]:
    """The create_custom_loss body, validated, and its graph checked (ops, arities, references,
    sizes, shapes). CPU work: the route runs it in the parser thread."""
    body = CreateCustomLossRequest.model_validate_json(raw)
    spec = custom_loss.parse(body.name, body.inputs, body.graph)
    _SPECS.put(hashlib.sha256(spec.canonical.encode()).hexdigest(), _Signature.of(spec))
    return body, spec


def store(db, row: CustomLossRow) -> CustomLossRow | None:
    """Stores a new loss, its session's count and its owner's bytes counted in the inserting
    transaction (Database.add_admitted); the loss already stored under its id if there is one."""
    if db.add_admitted(row, lambda conn: _admit(conn, row)):
        return None
    return db.get(CustomLossRow, row.loss_id)


def _admit(conn: Connection, row: CustomLossRow) -> None:
    stored = conn.execute(select(func.count()).where(_LOSSES.session_id == row.session_id)).scalar() - 1
    if stored >= custom_loss.MAX_LOSSES_PER_SESSION:
        raise UserError(f"session {row.session_id} has created {stored} custom losses, the most one session may "
                        f"({custom_loss.MAX_LOSSES_PER_SESSION}); reuse their LossHandles or start a new session")
    used = _SIZES.total(conn, row)
    if used > MAX_BYTES_PER_USER:
        raise UserError(f"your custom losses would hold {used} bytes of graphs with this one, over the "
                        f"{MAX_BYTES_PER_USER} bytes one user may store; close the ServiceClients whose losses "
                        f"you no longer use (a closed session's losses are deleted)")


class _Sizes:
    """The bytes of stored losses by loss id. A stored loss never changes, so each one's size is
    read once per gateway; a user's total is then their loss ids, read from the rows' leading
    columns (a graph is Text on overflow pages that summing its lengths would read whole, every
    time, holding SQLite's write lock), and this memo."""

    def __init__(self, capacity: int):
        self._items: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def total(self, conn: Connection, new: CustomLossRow) -> int:
        """The bytes of `new`'s owner's stored losses, `new` (inserted in this transaction) included."""
        sessions = select(SessionRow.session_id).where(SessionRow.owner == new.owner)     # through both indexes
        ids = conn.execute(select(_LOSSES.loss_id).where(_LOSSES.session_id.in_(sessions),
                                                         _LOSSES.owner == new.owner)).scalars().all()
        with self._lock:
            sizes = {i: self._items[i] for i in ids if i in self._items}
        sizes.setdefault(new.loss_id, len(new.spec_json))
        missing = [i for i in ids if i not in sizes]
        for start in range(0, len(missing), 500):
            sizes.update(conn.execute(select(_LOSSES.loss_id, func.length(_LOSSES.spec_json)).where(
                _LOSSES.loss_id.in_(missing[start:start + 500]))).all())
        with self._lock:
            for i in ids:
                self._items[i] = sizes[i]
                self._items.move_to_end(i)
            while len(self._items) > self._capacity:
                self._items.popitem(last=False)
        return sum(sizes[i] for i in ids)


_SIZES = _Sizes(1 << 16)


@dataclasses.dataclass(frozen=True)
class _Signature:
    """What forward_backward checks a datum against."""
    name: str
    inputs: tuple[tuple[str, int], ...]     # (name, rank), logprobs first

    @classmethod
    def of(cls, spec: custom_loss.LossSpec) -> "_Signature":
        return cls(spec.name, spec.inputs)


class _Specs:
    """Parsed specs' signatures by the SHA-256 of their canonical JSON (LRU, thread-safe)."""

    def __init__(self, capacity: int):
        self._items: collections.OrderedDict[str, _Signature] = collections.OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()
        self.parses = 0

    def get(self, digest: str) -> _Signature | None:
        with self._lock:
            found = self._items.get(digest)
            if found is not None:
                self._items.move_to_end(digest)
            return found

    def put(self, digest: str, signature: _Signature) -> None:
        with self._lock:
            self._items[digest] = signature
            self._items.move_to_end(digest)
            while len(self._items) > self._capacity:
                self._items.popitem(last=False)

    def parse(self, digest: str, canonical: str) -> _Signature:
        """A stored spec, checked again (the reader trusts no row): in the parser thread, once per digest."""
        signature = _Signature.of(custom_loss.from_canonical(canonical))
        self.put(digest, signature)
        with self._lock:
            self.parses += 1
        return signature


_SPECS = _Specs(4096)


async def for_forward_backward(db, caller: Caller, session_id: str, loss_id: str | None,
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
    digest = hashlib.sha256(row.spec_json.encode()).hexdigest()
    signature = _SPECS.get(digest) or await parsed(_SPECS.parse, digest, row.spec_json)
    for i, datum in enumerate(data):
        _check_datum(signature, i, datum.inputs)
    return trainer_pb2.CustomLoss(loss_id=loss_id, spec_json=row.spec_json)


def _check_datum(signature: _Signature, i: int, inputs: dict[str, np.ndarray]) -> None:
    for name, rank in signature.inputs[1:]:
        value = inputs.get(name)
        if value is None:
            raise UserError(f"datum {i}: loss_fn_inputs has no {name!r}, which custom loss {signature.name!r} reads")
        # On the wire a rank-0 value is a 1-element tensor of shape [] (sent as [1]).
        actual = 0 if value.size == 1 and rank == 0 else value.ndim
        if actual != rank:
            raise UserError(f"datum {i}: loss_fn_inputs[{name!r}] has shape {list(value.shape)}, but custom loss "
                            f"{signature.name!r} declared {name} with rank {rank}")


def forget_session(db, session_id: str) -> int:
    """A closed session's losses: no model of it can train again, so they go (returns how many)."""
    with db.session() as s:
        deleted = s.execute(delete(CustomLossRow).where(CustomLossRow.session_id == session_id)).rowcount
        s.commit()
    return deleted
