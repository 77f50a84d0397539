"""Each model's training jobs in seq_id order: a job's task (gateway/jobs/engine.py) takes its turn
(`put`, then `async with turn`); one runner per model with work on this gateway starts the turns.

The SDK posts the chunks of one call concurrently (first chunk last), so a runner holds back a
request until every lower seq_id has run or is known to another gateway, waiting a bounded time
for a gap to fill. The trainer enforces the same order itself (trainer_service/seq_order.py),
since requests of one model may reach different gateways.

A request below a seq_id sent already (another gateway's, re-driven here once that gateway
stopped) starts at once: the trainer holds the higher one for it.

That lets a runner send a model's next step while the one before it runs (OVERLAPPING): the
trainer then has it when the step ends, instead of idling through this gateway's bookkeeping of
the step (its reply converted, its future stored) and the round trip to send the next (on a GPU,
~7 ms a request of idle device at the 1B shape: docs/gpu.md). Only steps overlap, and only the
next seq_id: a model's creation, weight pushes and saves, whose gateway side the next request may
depend on, run alone, as do requests after a gap. The trainer holds the early one in the model's
order; no gap timeout runs for it there, since the step it waits for already arrived (a gRPC
retry of that step after a trainer restart is resent within seconds, under the 10 s timeout).
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from typing import Awaitable, Callable

log = logging.getLogger(__name__)

Elsewhere = Callable[[str], Awaitable[bool]]          # is the request of this key another gateway's?
GaveUp = Callable[[str, int, int], None]     # (model_id, lo, hi): seq_id lo waited out, hi starting after it
OVERLAPPING = frozenset({"forward", "forward_backward", "optim_step"})    # request types sent while a step runs
IN_FLIGHT = 2              # a model's steps sent to the trainer and not yet answered, at most
GAP_TIMEOUT_S = 10.0
_GAP_POLL_S = 0.1          # how often a gap is checked against the other gateways' futures
RUNNER_IDLE_S = 600.0      # an idle model's runner is dropped after this long (housekeeping)


class Turn:
    """A request's place in its model's order: `async with turn:` waits until it may run, and
    gives its place up when the block ends (ran, failed or cancelled)."""

    def __init__(self, runner: "_ModelRunner", seq: int, request_id: str, kind: str):
        self.runner, self.seq, self.request_id, self.kind = runner, seq, request_id, kind
        self.started = asyncio.Event()
        self.task: asyncio.Task | None = None      # the task that waits for it (cancelled by forget)

    def __lt__(self, other: "Turn") -> bool:
        return (self.seq, self.request_id) < (other.seq, other.request_id)

    async def __aenter__(self) -> "Turn":
        self.task = asyncio.current_task()
        try:
            await self.started.wait()
        except BaseException:       # cancelled while it waited: its place goes
            self.runner.ended(self)
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        self.runner.ended(self)


class _ModelRunner:
    """Starts one model's turns in seq_id order, the next step overlapping the one that runs."""

    def __init__(self, model_id: str, next_seq: int, elsewhere: Elsewhere, gave_up: GaveUp | None = None):
        self.model_id = model_id
        self.next_seq = next_seq
        self._elsewhere = elsewhere
        self._gave_up = gave_up
        self.heap: list[Turn] = []                # waiting, lowest seq_id first
        self.running: dict[str, Turn] = {}        # request_id -> its turn
        self.changed = asyncio.Event()        # a request arrived or one ended
        self.idle_since = time.monotonic()
        self.task = asyncio.create_task(self._loop())

    def put(self, seq: int, request_id: str, kind: str) -> Turn:
        turn = Turn(self, seq, request_id, kind)
        heapq.heappush(self.heap, turn)
        if self.heap[0].seq <= self.next_seq and self._may_start_head():
            self._start_head()        # now, not a turn of the event loop later (below)
        self.changed.set()
        return turn

    def ended(self, turn: Turn) -> None:
        if self.running.pop(turn.request_id, None) is None and turn in self.heap:
            self.heap.remove(turn)          # cancelled while it waited
            heapq.heapify(self.heap)
        self.changed.set()

    def _may_start_head(self) -> bool:
        """Nothing runs; or the head is late (below a seq_id sent already); or only steps run,
        fewer than IN_FLIGHT, and the head is the next step."""
        if not self.running:
            return True
        head = self.heap[0]
        if head.seq < self.next_seq:
            # Another gateway's, re-driven here after it stopped: the higher seq_id sent meanwhile
            # waits in the trainer for this one, so this one must not wait for it.
            return True
        return (len(self.running) < IN_FLIGHT and head.seq == self.next_seq and head.kind in OVERLAPPING
                and all(t.kind in OVERLAPPING for t in self.running.values()))

    async def _loop(self) -> None:
        gap_since = None
        while True:
            if not self.heap or not self._may_start_head():
                if not self.heap and not self.running:
                    self.idle_since = time.monotonic()
                self.changed.clear()
                await self.changed.wait()
                continue
            if self.heap[0].seq > self.next_seq:
                head, expected = self.heap[0].seq, self.next_seq
                elsewhere = await self._elsewhere(f"{self.model_id}#{expected}")
                if not self.heap or (self.heap[0].seq, self.next_seq) != (head, expected) or not self._may_start_head():
                    continue          # changed while the database was asked: look again
                if not elsewhere:
                    gap_since = gap_since or time.monotonic()
                    if time.monotonic() - gap_since < GAP_TIMEOUT_S:
                        self.changed.clear()
                        try:
                            await asyncio.wait_for(self.changed.wait(), _GAP_POLL_S)
                        except asyncio.TimeoutError:
                            pass
                        continue          # re-check the head
                    log.warning("seq %d of %s never arrived; running seq %d", self.next_seq, self.model_id,
                                self.heap[0].seq)
                    if self._gave_up is not None:       # the trainer need not wait it out again
                        self._gave_up(self.model_id, self.next_seq, self.heap[0].seq)
            gap_since = None
            self._start_head()

    def _start_head(self) -> None:
        turn = heapq.heappop(self.heap)
        self.next_seq = max(self.next_seq, turn.seq + 1)
        self.running[turn.request_id] = turn
        turn.started.set()

    def ahead_of(self, request_id: str) -> int | None:
        """Requests of this model that run before `request_id`; None if it is not queued here.
        A step sent while the one before it runs has that one ahead of it (the trainer holds it)."""
        if request_id in self.running:
            mine = self.running[request_id].seq
            return sum(1 for t in self.running.values() if t.seq < mine)
        seqs = [t.seq for t in self.heap if t.request_id == request_id]
        if not seqs:
            return None
        return sum(1 for t in self.heap if t.seq < seqs[0]) + len(self.running)

    def cancel(self) -> None:
        self.task.cancel()
        for turn in [*self.running.values(), *self.heap]:
            if turn.task is not None:
                turn.task.cancel()


class ModelOrder:
    """The runners of the models with training jobs on this gateway."""

    def __init__(self, elsewhere: Elsewhere, gave_up: GaveUp | None = None):
        """`elsewhere(idempotency_key)` says whether another gateway has that (model_id, seq_id):
        then the trainer orders it with ours and nobody waits here. `gave_up(model_id, lo, hi)`
        is told of each gap waited out, before the request after it starts."""
        self._elsewhere = elsewhere
        self._gave_up = gave_up
        self._runners: dict[str, _ModelRunner] = {}

    def put(self, model_id: str, seq_id: int, request_id: str, request_type: str) -> Turn:
        """The request's turn, taken now: it may be running already when this returns."""
        runner = self._runners.get(model_id)
        if runner is None:
            runner = self._runners[model_id] = _ModelRunner(model_id, seq_id, self._elsewhere, self._gave_up)
        return runner.put(seq_id, request_id, request_type)

    def position(self, model_id: str | None, request_id: str) -> tuple[bool, int]:
        """(running now, requests of the same model ahead of it) for a pending training future."""
        runner = self._runners.get(model_id or "")
        ahead = runner.ahead_of(request_id) if runner else None
        return (runner is not None and request_id in runner.running and ahead == 0), (ahead or 0)

    def forget(self, model_id: str) -> None:
        """The model is gone: its runner stops and the tasks holding or awaiting its turns are cancelled."""
        runner = self._runners.pop(model_id, None)
        if runner:
            runner.cancel()

    def drop_idle(self, idle_s: float = RUNNER_IDLE_S) -> int:
        """Forgets the runners of models with nothing queued for `idle_s` (housekeeping): memory
        stays bounded by the models in use. A later request makes a new one."""
        cutoff = time.monotonic() - idle_s
        idle = [m for m, r in self._runners.items() if not r.heap and not r.running and r.idle_since < cutoff]
        for model_id in idle:
            self.forget(model_id)
        return len(idle)

    def stop(self) -> None:
        for runner in self._runners.values():
            runner.cancel()
