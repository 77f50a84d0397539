"""Fair scheduling of engine work across tenants.

The engine runs one piece of work at a time (the shared PEFT model has one active adapter).
Who goes next is decided here, not by whichever gRPC thread grabs a lock first: among the
tenants with queued work, the one that has used the least engine time goes next (start-time
fair queuing on measured seconds). A tenant that floods the trainer, even through many models,
gets its share and no more; a tenant returning from idle starts level with the busiest active
tenant, so idle time is not banked as credit. Within one tenant work runs in arrival order.

A tenant is a user: the gateway names the owner of each request in the call's metadata
(tinkerd.rpc TENANT_METADATA), so one user's many sessions and models share one user's share. Work without
it (the trainer's own, a client other than the gateway) is its model's session's: model ids look
like "{session_id}:train:{n}"; any other id is its own tenant.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
import time
from typing import Any, Callable

from tinkerd.rpc import TENANT_METADATA


_KEEP_IDLE = 1024     # idle tenants whose used time is remembered


def tenant_of(model_id: str, metadata=()) -> str:
    """The user named in the call's metadata, else the model's session."""
    for key, value in metadata or ():
        if key == TENANT_METADATA and value:
            return value
    return model_id.split(":train:", 1)[0]


@dataclasses.dataclass
class QueueSnapshot:
    running: str | None                 # tenant whose work is executing now
    queued: dict[str, int]              # tenant -> number of queued items
    used_seconds: dict[str, float]


class FairScheduler:
    def __init__(self):
        self._queues: dict[str, collections.deque] = {}
        self._used: dict[str, float] = collections.defaultdict(float)
        self._running: str | None = None
        self._idle_since = time.monotonic()
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="fair-scheduler", daemon=True)
        self._thread.start()

    def run(self, tenant: str, fn: Callable, *, before: Callable[[], Any] | None = None,
            after: Callable[[Any, float], Any] | None = None):
        """Runs `fn()` on the engine thread when it is `tenant`'s turn; returns or raises its result.
        `before()` and `after(result, seconds)` are short steps of the same turn around it (the
        ledger's: a model brought back from disk, the journal): a `before()` that returns something
        other than None is the answer, and `fn` does not run; else the answer is `after` of fn's
        result and the seconds fn took."""
        return self.submit(tenant, fn, before=before, after=after).result()

    def submit(self, tenant: str, fn: Callable, *, before: Callable[[], Any] | None = None,
               after: Callable[[Any, float], Any] | None = None) -> concurrent.futures.Future:
        """Queues `fn()` for `tenant`'s turn without waiting (with `before`, `after` as for `run`):
        the future of its answer."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            queue = self._queues.get(tenant)
            if queue is None:
                queue = self._queues[tenant] = collections.deque()
                # Level with the least-served active tenant: no credit for having been idle.
                active = [self._used[t] for t in self._queues if t != tenant] + (
                    [self._used[self._running]] if self._running else [])
                if active:
                    self._used[tenant] = max(self._used[tenant], min(active))
            queue.append((fn, before, after, future))
            self._cv.notify()
        return future

    def snapshot(self) -> QueueSnapshot:
        with self._cv:
            return QueueSnapshot(self._running, {t: len(q) for t, q in self._queues.items()}, dict(self._used))

    def idle_for(self) -> float:
        """Seconds since the last work finished, if none is running or queued now; else 0."""
        with self._cv:
            if self._running or self._queues:
                return 0.0
            return time.monotonic() - self._idle_since

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queues:
                    self._cv.wait()
                tenant = min(self._queues, key=lambda t: self._used[t])
                queue = self._queues[tenant]
                fn, before, after, future = queue.popleft()
                if not queue:
                    del self._queues[tenant]
                self._running = tenant
            t0 = time.perf_counter()
            try:
                if future.set_running_or_notify_cancel():
                    answer = before() if before is not None else None
                    if answer is None:
                        started = time.perf_counter()
                        result = fn()           # the work itself, called from here: no frame between
                        answer = result if after is None else after(result, time.perf_counter() - started)
                    future.set_result(answer)
            except BaseException as e:  # noqa: BLE001 - the caller re-raises it
                future.set_exception(e)
            finally:
                with self._cv:
                    self._used[tenant] += time.perf_counter() - t0
                    self._running = None
                    self._idle_since = time.monotonic()
                    if len(self._used) > len(self._queues) + _KEEP_IDLE:
                        self._forget_idle()

    def _forget_idle(self) -> None:
        """Drops the used time of idle tenants that would be levelled up on return anyway (at or
        below every active tenant's); if that is not enough, the least-served idle ones, down to
        half the limit so this runs rarely."""
        idle = [t for t in self._used if t not in self._queues]
        if self._queues:
            floor = min(self._used[t] for t in self._queues)
            for t in [t for t in idle if self._used[t] <= floor]:
                del self._used[t]
            idle = [t for t in self._used if t not in self._queues]
        for t in sorted(idle, key=self._used.__getitem__)[:max(0, len(idle) - _KEEP_IDLE // 2)]:
            del self._used[t]
