"""The trainer's ledger of requests: each (model_id, seq_id) runs at most once, in seq_id order,
and a resend gets the first reply -- also after a restart, for what the model's durable state
includes. Every request that changes a model goes through `run` (forward_backward and forward,
optim_step, save_state, push_weights), which does, in this order:

1. the request's turn in its model's seq_id order (seq_order.py);
2. a stored reply (replies.py): a resend, or a copy re-driven by another gateway, is answered;
3. in the tenant's fair turn (scheduler.py), the work run by the scheduler's engine thread itself,
   the ledger's steps of the turn short calls around it: before it (`_resume`), a model that
   waits on disk brought back (`Models`) and squared with its journal, which may answer the
   request (its reply is kept there: the work does not run) or refuse it once, saying so, when
   work done before a crash is lost;
4. after it (`_journal`), still in the turn: the reply made of the work's result, and the journal
   (durable.py), decided by the request's kind: which requests the durable state includes; after
   an optim_step, the durable write when due;
5. the reply kept for resends.

PushWeights' transfer runs after its fair turn (`outside_turn`), still in its seq_id turn: the
samplers' receive does not hold other tenants' work.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
from typing import Any, Callable, Protocol, TypeVar

from tinkerd.errors import LostWorkError, UserError
from tinkerd.v1 import trainer_pb2
from trainer_service.durable import DurableModels, describe_lost
from trainer_service.replies import APPLIED, ReplyCache
from trainer_service.scheduler import FairScheduler
from trainer_service.seq_order import SeqOrder

log = logging.getLogger(__name__)

Reply = TypeVar("Reply")


@dataclasses.dataclass(frozen=True)
class _Kind:
    journaled: bool = False         # changes the model: a journal line, so a restart knows
    reply: type | None = None       # the reply the journal keeps, to answer a resend after a restart
    step: bool = False              # an optimizer step: the durable state may be due


_KINDS = {
    "forward": _Kind(),
    "forward_backward": _Kind(journaled=True),
    "optim_step": _Kind(journaled=True, reply=trainer_pb2.OptimStepResponse, step=True),
    "save_state": _Kind(),
    "push_weights": _Kind(),
}


class Models(Protocol):
    """What the ledger asks of the engine (TrainerEngine is one)."""

    def is_resident(self, model_id: str) -> bool: ...

    def on_disk(self, model_id: str) -> bool: ...

    def get(self, model_id: str) -> Any:
        """The model, brought back from disk if need be: its `state_seq` and `step`."""

    def save_durable(self, model_id: str) -> None: ...


@dataclasses.dataclass(frozen=True)
class _Call:
    model_id: str
    seq: int
    kind: str
    tenant: str


class Ledger:
    def __init__(self, durable: DurableModels, models: Models, turns: FairScheduler):
        self.durable = durable
        self.models = models
        self.turns = turns
        self.replies = ReplyCache()
        self.order = SeqOrder(start_of=durable.next_turn)

    def run(self, request, kind: str, work: Callable[[], Any], *, tenant: str,
            reply: Callable[[Any], Any] | None = None, ran: Callable[[float], None] | None = None,
            outside_turn: Callable[[Any], Reply] | None = None) -> Reply:
        """The reply to `request` (its model_id and seq_id): `work()` run in its turns, unless it
        ran before: then its stored reply, or a refusal when that reply is no longer kept (never a
        second run). `reply(result)` makes the reply of the work's result, still in the turn (the
        journal may keep it); `ran(seconds)` is told the work's own seconds once it ran here, after
        the turn. With `outside_turn`, the reply is `outside_turn(work())`, made after the fair
        turn; such a kind changes no model (nothing to journal)."""
        call = _Call(request.model_id, request.seq_id, kind, tenant)
        if outside_turn is not None and _KINDS[kind].journaled:
            raise ValueError(f"{kind} is journaled in its turn: its reply cannot be made outside it")
        kept = self.replies.get(call.model_id, call.seq, kind)
        if kept is not None:
            return kept
        ran_before = self.order.wait_turn(call.model_id, call.seq)
        applied = True
        try:
            kept = self.replies.get(call.model_id, call.seq, kind)    # sent meanwhile by another gateway
            if kept is not None:
                return kept
            if ran_before:
                raise _expired(kind, call.model_id, call.seq)
            applied = False
            result, seconds = self.turns.run(tenant, work, before=functools.partial(self._resume, call),
                                             after=functools.partial(self._journal, call, reply))
            answer = result if seconds is None or outside_turn is None else outside_turn(result)
            applied = True
            self.replies.put(call.model_id, call.seq, kind, answer)
            if seconds is not None and ran is not None:
                ran(seconds)
            return answer
        finally:
            self.order.executed(call.model_id, call.seq, applied)
            self.durable.note_turn(call.model_id, call.seq)

    def _resume(self, call: _Call) -> tuple[Any, None] | None:
        """In the turn, before the work: the model back from disk if it waits there; then, if that
        brought back this request's reply, the answer (its seconds None: the work does not run)."""
        self._bring_back(call)
        kept = self.replies.get(call.model_id, call.seq, call.kind)
        return None if kept is None else (kept, None)

    def _journal(self, call: _Call, reply: Callable[[Any], Any] | None, result, seconds: float) -> tuple[Any, float]:
        """In the turn, after the work: the reply made of its result, then journaled; the answer
        with the work's seconds."""
        answer = reply(result) if reply is not None else result
        self._record(call, answer)
        return answer, seconds

    def _bring_back(self, call: _Call) -> None:
        """A model brought back from disk, its state at `state_seq`: the journal tells which
        requests that state includes (their replies are kept for resends) and which were lost in a
        crash. Then this request is refused, once, saying so -- unless it is the resend of the one
        request lost (the call in flight when the trainer died), which redoes exactly what was lost."""
        if self.models.is_resident(call.model_id) or not self.models.on_disk(call.model_id):
            return
        model = self.models.get(call.model_id)
        entries = self.durable.journal(call.model_id)
        for e in entries:
            if e.seq <= model.state_seq:
                reply = _KINDS[e.kind].reply.FromString(e.reply) if e.reply is not None else APPLIED
                self.replies.put(call.model_id, e.seq, e.kind, reply)
        lost = [e for e in entries if e.seq > model.state_seq]
        if lost:
            self.durable.trim(call.model_id, model.state_seq)
        if lost and [e.seq for e in lost] != [call.seq]:
            raise LostWorkError(
                f"the trainer restarted and model {call.model_id} resumed from its state at step {model.step} "
                f"(seq_id {model.state_seq}); these requests were done but are lost: {describe_lost(lost)}. "
                f"Send them again to redo them; requests from now on apply to the resumed state")

    def _record(self, call: _Call, reply) -> None:
        """What the request's kind changed, journaled before its reply leaves (durable.py); after
        an optimizer step, the model's durable state once the last write is older than the interval."""
        kind = _KINDS[call.kind]
        if kind.journaled:
            self.durable.record(call.model_id, call.seq, call.kind,
                                reply.SerializeToString() if kind.reply is not None else None)
        if kind.step and self.durable.due(call.model_id):
            self._write_durable(call)

    def _write_durable(self, call: _Call) -> None:
        """With --durable-interval-s 0 (every step) before the reply: an answered step is on disk.
        Otherwise the state may lag by the interval anyway, so the write goes right after the
        reply, as the tenant's next turn: the step's caller has its reply sooner, though its next
        call on the model waits for the write (an RL loop's weight push). Deferred past the push,
        it ran beside a CPU sampler's compute and cost the step more than that
        (docs/benchmarks.md#in-the-trainer)."""
        model_id = call.model_id
        if self.durable.interval_s <= 0:
            self.models.save_durable(model_id)
            return

        def report(write: concurrent.futures.Future) -> None:
            if write.exception() is not None:
                log.error("could not write the durable state of %s (tried again after its next step or when "
                          "idle)", model_id, exc_info=write.exception())
        self.turns.submit(call.tenant, lambda: self.models.save_durable(model_id)).add_done_callback(report)

    def created(self, model_id: str, after: int = 0) -> None:
        """The model was made here: its requests start at the seq_id after `after` (1, or after
        the load into an existing model that replaced it)."""
        self.order.created(model_id, after)
        self.durable.note_turn(model_id, after, created=True)

    def refused(self, request) -> None:
        """A request refused before its work (its message did not convert): its turn taken, and
        not applied unless an earlier copy was, as when its work fails, so the model's next
        seq_id does not wait out the gap timeout for it."""
        ran_before = self.order.wait_turn(request.model_id, request.seq_id)
        self.order.executed(request.model_id, request.seq_id, applied=ran_before)
        self.durable.note_turn(request.model_id, request.seq_id)

    def skip(self, model_id: str, seq: int) -> None:
        """A seq_id refused before it reached the trainer: taken in its turn, not applied."""
        self.order.wait_turn(model_id, seq)
        self.order.executed(model_id, seq, applied=False)
        self.durable.note_turn(model_id, seq)

    def waive(self, model_id: str, lo: int, hi: int) -> None:
        """seq_ids [lo, hi) given up on by a gateway (seq_order.py waive)."""
        self.order.waive(model_id, lo, hi)

    def forget(self, model_id: str) -> None:
        self.replies.forget(model_id)
        self.order.forget(model_id)


def _expired(kind: str, model_id: str, seq: int) -> UserError:
    """A late copy of a request that executed here and whose reply was since dropped
    (replies.py keeps the latest within a byte budget): applying it again would apply it twice."""
    return UserError(f"{kind} seq_id {seq} of {model_id} was already executed and its result is no longer "
                     f"kept (later requests pushed it out of the trainer's reply cache); it is not applied "
                     f"twice. Send a new request")
