"""A model's requests execute in seq_id order, whichever gateway sends them.

Several gateways may each hold some of one model's requests (the SDK spreads them over a load
balancer; a re-driven request comes from whichever gateway claimed it), so only the trainer can
order them. A request waits here until every lower seq_id of its model has executed (or was
refused), or for at most `gap_timeout_s` for a seq_id that never arrives (the SDK used it for a
request that was refused before reaching the trainer). A resend of an executed request is
answered from the reply cache before it gets here (replies.py), so it never waits; one that
arrives while its first copy still runs (the gateway that sent it died, another re-drives it)
waits for that copy and then gets its reply, instead of running twice.

A model's order starts at 1 once it is made here (seq 0 is its creation); a model this process
did not make (it came back from disk after a restart) starts at the first seq_id it sees.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

log = logging.getLogger(__name__)

GAP_TIMEOUT_S = 10.0
_MODELS_KEPT = 100_000     # models whose next seq_id is remembered (oldest forgotten first)


class SeqOrder:
    def __init__(self, gap_timeout_s: float = GAP_TIMEOUT_S):
        self.gap_timeout_s = gap_timeout_s
        self._next: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._running: set[tuple[str, int]] = set()
        self._cv = threading.Condition()

    def wait_turn(self, model_id: str, seq: int) -> None:
        """Blocks until every lower seq_id of the model has executed (or the gap timeout passed)
        and no other copy of this request runs; then it counts as running until executed()."""
        deadline = time.monotonic() + self.gap_timeout_s
        with self._cv:
            self._next.setdefault(model_id, seq)
            self._next.move_to_end(model_id)
            gap_waived = False
            while (model_id, seq) in self._running or (seq > self._next.get(model_id, seq) and not gap_waived):
                left = deadline - time.monotonic()
                if (model_id, seq) not in self._running and left <= 0:
                    log.warning("%s: seq_id %d never arrived; running seq_id %d", model_id,
                                self._next.get(model_id, seq), seq)
                    gap_waived = True
                    continue
                self._cv.wait(left if left > 0 else 0.1)
            self._running.add((model_id, seq))

    def executed(self, model_id: str, seq: int) -> None:
        """seq ran (or was refused): the next one may go."""
        with self._cv:
            self._running.discard((model_id, seq))
            self._next[model_id] = max(self._next.get(model_id, 0), seq + 1)
            self._next.move_to_end(model_id)
            while len(self._next) > _MODELS_KEPT:
                self._next.popitem(last=False)
            self._cv.notify_all()

    def created(self, model_id: str) -> None:
        """The model was made here (its seq 0): its requests start at seq_id 1."""
        self.executed(model_id, 0)

    def forget(self, model_id: str) -> None:
        with self._cv:
            self._next.pop(model_id, None)
            self._cv.notify_all()

    def next_of(self, model_id: str) -> int | None:
        with self._cv:
            return self._next.get(model_id)
