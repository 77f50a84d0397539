"""Each model's training jobs in seq_id order, one runner per model with work on this gateway.

The SDK posts the chunks of one call concurrently (first chunk last), so a runner holds back a
request until every lower seq_id has run or is known to another gateway, waiting a bounded time
for a gap to fill. The trainer enforces the same order itself (trainer_service/seq_order.py),
since requests of one model may reach different gateways.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from typing import Awaitable, Callable

log = logging.getLogger(__name__)

Job = Callable[[], Awaitable[tuple[str, bytes]]]     # a job bound to the gateway
RunFuture = Callable[[str, Job], Awaitable[None]]     # runs a future's job and finishes the future
GAP_TIMEOUT_S = 10.0
_GAP_POLL_S = 0.1          # how often a gap is checked against the other gateways' futures
RUNNER_IDLE_S = 600.0      # an idle model's runner is dropped after this long (housekeeping)


class _ModelRunner:
    """Runs one model's jobs in seq_id order."""

    def __init__(self, model_id: str, next_seq: int, run: RunFuture, elsewhere: Callable[[str], bool]):
        self.model_id = model_id
        self.next_seq = next_seq
        self._run, self._elsewhere = run, elsewhere
        self.heap: list[tuple[int, str, Job]] = []
        self.running: str | None = None
        self.arrived = asyncio.Event()
        self.idle_since = time.monotonic()
        self.task = asyncio.create_task(self._loop())

    def put(self, seq: int, request_id: str, job: Job) -> None:
        heapq.heappush(self.heap, (seq, request_id, job))
        self.arrived.set()

    async def _loop(self) -> None:
        gap_since = None
        while True:
            if not self.heap:
                self.idle_since = time.monotonic()
                self.arrived.clear()
                await self.arrived.wait()
                continue
            if self.heap[0][0] > self.next_seq and not self._elsewhere(f"{self.model_id}#{self.next_seq}"):
                gap_since = gap_since or time.monotonic()
                if time.monotonic() - gap_since < GAP_TIMEOUT_S:
                    self.arrived.clear()
                    try:
                        await asyncio.wait_for(self.arrived.wait(), _GAP_POLL_S)
                    except asyncio.TimeoutError:
                        pass
                    continue          # re-check the head
                log.warning("seq %d of %s never arrived; running seq %d", self.next_seq, self.model_id,
                            self.heap[0][0])
            gap_since = None
            seq, request_id, job = heapq.heappop(self.heap)
            self.next_seq = max(self.next_seq, seq + 1)
            self.running = request_id
            try:
                await self._run(request_id, job)
            finally:
                self.running = None

    def ahead_of(self, request_id: str) -> int | None:
        """Requests of this model that run before `request_id`; None if it is not queued here."""
        if self.running == request_id:
            return 0
        seqs = [seq for seq, rid, _ in self.heap if rid == request_id]
        if not seqs:
            return None
        return sum(1 for seq, _, _ in self.heap if seq < seqs[0]) + (self.running is not None)


class ModelOrder:
    """The runners of the models with training jobs on this gateway."""

    def __init__(self, run: RunFuture, elsewhere: Callable[[str], bool]):
        """`run` runs a future's job; `elsewhere(idempotency_key)` says whether another gateway
        has that (model_id, seq_id): then the trainer orders it with ours and nobody waits here."""
        self._run, self._elsewhere = run, elsewhere
        self._runners: dict[str, _ModelRunner] = {}

    def put(self, model_id: str, seq_id: int, request_id: str, job: Job) -> None:
        runner = self._runners.get(model_id)
        if runner is None:
            runner = self._runners[model_id] = _ModelRunner(model_id, seq_id, self._run, self._elsewhere)
        runner.put(seq_id, request_id, job)

    def position(self, model_id: str | None, request_id: str) -> tuple[bool, int]:
        """(running now, requests of the same model ahead of it) for a pending training future."""
        runner = self._runners.get(model_id or "")
        ahead = runner.ahead_of(request_id) if runner else None
        return (runner is not None and runner.running == request_id), (ahead or 0)

    def forget(self, model_id: str) -> None:
        runner = self._runners.pop(model_id, None)
        if runner:
            runner.task.cancel()

    def drop_idle(self, idle_s: float = RUNNER_IDLE_S) -> int:
        """Forgets the runners of models with nothing queued for `idle_s` (housekeeping): memory
        stays bounded by the models in use. A later request makes a new one."""
        cutoff = time.monotonic() - idle_s
        idle = [m for m, r in self._runners.items() if not r.heap and r.running is None and r.idle_since < cutoff]
        for model_id in idle:
            self.forget(model_id)
        return len(idle)

    def stop(self) -> None:
        for runner in self._runners.values():
            runner.task.cancel()
