"""A model's requests execute in seq_id order, whichever gateway sends them.

Several gateways may each hold some of one model's requests (the SDK spreads them over a load
balancer; a re-driven request comes from whichever gateway claimed it), so only the trainer can
order them. A request waits here until every lower seq_id of its model has executed (or was
refused), or for at most `gap_timeout_s` for a seq_id that never arrives (the SDK used it for a
request that was refused before reaching the trainer). A seq_id that is running is no gap, however
long its step: the next one waits for it (it used to be let through after the timeout while the
step ran, which left that seq_id counted as not applied, so a late copy could have run it twice).
A resend of an executed request is answered from the reply cache before it gets here
(replies.py), so it never waits; one that arrives while its first copy still runs (the gateway
that sent it died, another re-drives it) waits for that copy and then gets its reply, instead of
running twice.

A model's order starts at 1 once it is made here, new or from a checkpoint (seq 0 is its
creation); a model this process did not make (it came back from disk after a restart) starts
after the newest seq_id an earlier process took its turn on (durable.py's last_seq, written from
the creation on), so requests arriving out of order (through several gateways, or a gateway's
next step sent while one runs) still run in order; without that record, at the first seq_id it
sees.

A seq_id below the next one that this process saw execute, arriving again once its reply left the
reply cache (a re-drive after many later requests), is refused by the ledger instead of applied
twice: wait_turn() tells it so. Seq_ids skipped by the gap timeout, and requests that failed,
were not applied; those may still run late.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time

log = logging.getLogger(__name__)

GAP_TIMEOUT_S = 10.0
_MODELS_KEPT = 100_000     # models whose next seq_id is remembered (oldest forgotten first)
_SKIPPED_KEPT = 64         # per model, runs of seq_ids not applied (older ones forgotten: then refused)


@dataclasses.dataclass
class _Model:
    next: int                  # every seq_id in [floor, next) executed here, except `skipped`
    floor: int                 # the first seq_id seen (below it: from before this process)
    skipped: list[list[int]] = dataclasses.field(default_factory=list)    # [lo, hi) runs not applied

    def executed_before(self, seq: int) -> bool:
        """Did seq execute here already? A skipped seq_id about to run leaves `skipped`."""
        if not self.floor <= seq < self.next:
            return False
        for i, (lo, hi) in enumerate(self.skipped):
            if lo <= seq < hi:
                self.skipped[i:i + 1] = [r for r in ([lo, seq], [seq + 1, hi]) if r[0] < r[1]]
                return False
        return True

    def skip(self, lo: int, hi: int) -> None:
        if lo < hi:
            self.skipped.append([lo, hi])
            del self.skipped[:-_SKIPPED_KEPT]


class SeqOrder:
    def __init__(self, gap_timeout_s: float = GAP_TIMEOUT_S, start_of=None):
        """`start_of(model_id)`: the seq_id a model's order resumes at when this process first
        sees it (the one after the newest an earlier process took: durable.next_turn), None if
        unknown; then it starts at the first seq_id it sees."""
        self.gap_timeout_s = gap_timeout_s
        self.start_of = start_of
        self._models: collections.OrderedDict[str, _Model] = collections.OrderedDict()
        self._running: set[tuple[str, int]] = set()
        self._waiting: collections.Counter[tuple[str, int]] = collections.Counter()     # in wait_turn
        self._cv = threading.Condition()

    def _model(self, model_id: str, seq: int) -> _Model:
        model = self._models.get(model_id)
        if model is None:
            start = self.start_of(model_id) if self.start_of is not None else None
            start = seq if start is None else start
            model = self._models[model_id] = _Model(next=start, floor=start)
            while len(self._models) > _MODELS_KEPT:
                self._models.popitem(last=False)
        self._models.move_to_end(model_id)
        return model

    def wait_turn(self, model_id: str, seq: int) -> bool:
        """Blocks until every lower seq_id of the model has executed (or the gap timeout passed)
        and no other copy of this request runs; then it counts as running until executed().
        Returns True if this seq_id executed here before (a late copy: not to be applied again)."""
        deadline = time.monotonic() + self.gap_timeout_s
        with self._cv:
            self._waiting[(model_id, seq)] += 1
            try:
                return self._wait_turn(model_id, seq, deadline)
            finally:
                self._waiting[(model_id, seq)] -= 1
                if not self._waiting[(model_id, seq)]:
                    del self._waiting[(model_id, seq)]

    def _wait_turn(self, model_id: str, seq: int, deadline: float) -> bool:
        """wait_turn's body, under self._cv."""
        model = self._model(model_id, seq)
        gap_waived = False
        while (model_id, seq) in self._running or (seq > model.next and not gap_waived):
            if (model_id, model.next) in self._running:
                # The seq_id we wait for runs (sent by another gateway): no gap, however long it
                # takes. The gap timeout counts from when it is done and the next is missing.
                deadline = time.monotonic() + self.gap_timeout_s
            left = deadline - time.monotonic()
            if (model_id, seq) not in self._running and left <= 0:
                log.warning("%s: seq_id %d never arrived; running seq_id %d", model_id, model.next, seq)
                gap_waived = True
                continue
            self._cv.wait(left if left > 0 else 0.1)
            model = self._model(model_id, seq)       # forget() may have dropped it meanwhile
        if gap_waived and seq > model.next:
            model.skip(model.next, seq)
            model.next = seq
        self._running.add((model_id, seq))
        return model.executed_before(seq)

    def executed(self, model_id: str, seq: int, applied: bool = True) -> None:
        """seq ran, or was refused (`applied` False: it changed nothing, so a copy may run
        later): the next one may go."""
        with self._cv:
            self._running.discard((model_id, seq))
            model = self._model(model_id, seq)
            if not applied:
                model.skip(seq, seq + 1)
            model.next = max(model.next, seq + 1)
            self._cv.notify_all()

    def waive(self, model_id: str, lo: int, hi: int) -> None:
        """The seq_ids from `lo` up to `hi` will not come (a gateway waited out their gap): a
        request after them does not wait for them again. Only where this process's next seq_id
        is among them (its earlier ones all came); those executed keep their state, and the skip
        stops at the first one that is here, running or waiting for its turn."""
        with self._cv:
            model = self._models.get(model_id)
            if model is None or not lo <= model.next < hi:
                return
            end = min((s for m, s in (*self._running, *self._waiting) if m == model_id and model.next <= s < hi),
                      default=hi)
            model.skip(model.next, end)
            model.next = end
            self._cv.notify_all()

    def created(self, model_id: str, after: int = 0) -> None:
        """The model was made here (its seq 0, or `after`: the load that replaced it): its
        requests start at the seq_id after it."""
        with self._cv:
            self._models[model_id] = _Model(next=after, floor=after)
        self.executed(model_id, after)

    def forget(self, model_id: str) -> None:
        with self._cv:
            self._models.pop(model_id, None)
            self._cv.notify_all()

    def next_of(self, model_id: str) -> int | None:
        with self._cv:
            model = self._models.get(model_id)
            return model.next if model is not None else None
