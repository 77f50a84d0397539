"""The trainer's ledger of requests: each (model_id, seq_id) runs at most once, in seq_id order,
and a resend gets the first reply -- also after a restart, for what the model's durable state
includes. Every request that changes a model goes through `once` (forward_backward, optim_step,
save_state, push_weights); what it holds:

- the order (seq_order.py): a request waits for every lower seq_id of its model;
- the replies (replies.py): a resend, or a copy re-driven by another gateway, is answered;
- the journal (durable.py): which requests the durable state includes. A model brought back from
  disk (`resume`) takes their replies back, and refuses once, saying so, when work done before a
  crash is lost.
"""

from __future__ import annotations

from typing import Callable, TypeVar

from tinkerd.errors import LostWorkError, UserError
from tinkerd.v1 import trainer_pb2
from trainer_service.durable import DurableModels, describe_lost
from trainer_service.replies import APPLIED, ReplyCache
from trainer_service.seq_order import SeqOrder

Reply = TypeVar("Reply")

# The replies a restarted trainer can give again (the journal keeps them).
_JOURNALED_REPLIES = {"optim_step": trainer_pb2.OptimStepResponse}


class Ledger:
    def __init__(self, durable: DurableModels):
        self.durable = durable
        self.replies = ReplyCache()
        self.order = SeqOrder(start_of=durable.next_turn)

    def once(self, model_id: str, seq: int, kind: str, run: Callable[[], Reply]) -> Reply:
        """`run()`'s reply, run in the request's turn unless it ran before: then its stored reply,
        or a refusal when that reply is no longer kept (never a second run)."""
        cached = self.replies.get(model_id, seq, kind)
        if cached is not None:
            return cached
        ran_before = self.order.wait_turn(model_id, seq)
        applied = True
        try:
            cached = self.replies.get(model_id, seq, kind)    # the same request, sent meanwhile by another gateway
            if cached is not None:
                return cached
            if ran_before:
                raise _expired(kind, model_id, seq)
            applied = False
            reply = run()
            applied = True
            self.replies.put(model_id, seq, kind, reply)
            return reply
        finally:
            self.order.executed(model_id, seq, applied)
            self.durable.note_turn(model_id, seq)

    def resume(self, model_id: str, seq: int, state_seq: int, step: int) -> None:
        """A model just brought back from disk, its state at `state_seq`: the journal tells which
        requests that state includes (their replies are kept for resends) and which were lost in a
        crash. Then this request is refused, once, saying so -- unless it is the resend of the one
        request lost (the call in flight when the trainer died), which redoes exactly what was lost."""
        entries = self.durable.journal(model_id)
        for e in entries:
            if e.seq <= state_seq:
                reply = _JOURNALED_REPLIES[e.kind].FromString(e.reply) if e.reply is not None else APPLIED
                self.replies.put(model_id, e.seq, e.kind, reply)
        lost = [e for e in entries if e.seq > state_seq]
        if lost:
            self.durable.trim(model_id, state_seq)
        if lost and [e.seq for e in lost] != [seq]:
            raise LostWorkError(
                f"the trainer restarted and model {model_id} resumed from its state at step {step} "
                f"(seq_id {state_seq}); these requests were done but are lost: {describe_lost(lost)}. "
                f"Send them again to redo them; requests from now on apply to the resumed state")

    def stored(self, model_id: str, seq: int, kind: str):
        """The reply kept for the request (a resume may have just brought it back), else None."""
        return self.replies.get(model_id, seq, kind)

    def record(self, model_id: str, seq: int, kind: str, reply: bytes | None = None) -> None:
        """An executed request that changed the model, journaled before its reply leaves."""
        self.durable.record(model_id, seq, kind, reply)

    def created(self, model_id: str) -> None:
        """The model was made here: its requests start at seq_id 1."""
        self.order.created(model_id)
        self.durable.note_turn(model_id, 0, created=True)

    def skip(self, model_id: str, seq: int) -> None:
        """A seq_id refused before it reached the trainer: taken in its turn, not applied."""
        self.order.wait_turn(model_id, seq)
        self.order.executed(model_id, seq, applied=False)
        self.durable.note_turn(model_id, seq)

    def forget(self, model_id: str) -> None:
        self.replies.forget(model_id)
        self.order.forget(model_id)


def _expired(kind: str, model_id: str, seq: int) -> UserError:
    """A late copy of a request that executed here and whose reply was since dropped
    (replies.py keeps the latest within a byte budget): applying it again would apply it twice."""
    return UserError(f"{kind} seq_id {seq} of {model_id} was already executed and its result is no longer "
                     f"kept (later requests pushed it out of the trainer's reply cache); it is not applied "
                     f"twice. Send a new request")
