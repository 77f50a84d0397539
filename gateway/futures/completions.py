"""Completion queues for retrieve_futures: an SDK with `sample_use_retrieve_futures` (0.28 and
later) long-polls one queue per (sampling session, clone) for its finished samples, in place of
one retrieve_future long-poll per sample, then fetches each payload with retrieve_future.

Only an index, in memory: the futures table stays the source of truth for states and payloads.
An entry is a finished sample's id under a cursor. It leaves the queue when
- the client acknowledges it (a later poll's prev_cursor is at or past it),
- its payload is fetched with retrieve_future (the SDK does that only after the entry was
  reported; an SDK that does not poll fetches payloads directly, so its queues stay empty), or
- more than `max_entries` are queued over all sessions (abandoned clients): oldest first.
Cursors count up from the process's start time in microseconds, so they stay above the cursors
an earlier gateway process gave out and a client that polled it trims nothing new.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import time

Target = tuple[str, int]        # (sampling_session_id, cloned_sampler_id)
MAX_ENTRIES = 200_000


@dataclasses.dataclass(slots=True)
class Completion:
    cursor: int
    request_id: str
    failed: bool
    size: int                   # the payload's bytes (the SDK reserves its memory before fetching)


class _Queue:
    __slots__ = ("entries", "arrived", "waiters")

    def __init__(self):
        self.entries: collections.OrderedDict[str, Completion] = collections.OrderedDict()  # cursor order
        self.arrived = asyncio.Event()
        self.waiters = 0


class Completions:
    def __init__(self, max_entries: int = MAX_ENTRIES):
        self.max_entries = max_entries
        self._cursor = self.started = time.time_ns() // 1000    # cursors below `started` came from an earlier process
        self._queues: dict[Target, _Queue] = {}
        self._where: collections.OrderedDict[str, Target] = collections.OrderedDict()   # oldest first

    def add(self, target: Target, request_id: str, failed: bool, size: int) -> None:
        """A sample of `target` finished (again, for a resend: it moves to the end)."""
        self._cursor += 1
        queue = self._queues.get(target)
        if queue is None:
            queue = self._queues[target] = _Queue()
        queue.entries.pop(request_id, None)
        queue.entries[request_id] = Completion(self._cursor, request_id, failed, size)
        self._where.pop(request_id, None)
        self._where[request_id] = target
        queue.arrived.set()
        while len(self._where) > self.max_entries:
            old, old_target = self._where.popitem(last=False)
            self._drop(old_target, old)

    def discard(self, request_id: str, target: Target | None = None) -> None:
        """The payload was fetched: the client has it, whether or not it polled. With `target`,
        only if queued there (a client acknowledges only its own target's)."""
        where = self._where.get(request_id)
        if where is not None and (target is None or where == target):
            del self._where[request_id]
            self._drop(where, request_id)

    def _drop(self, target: Target, request_id: str) -> None:
        queue = self._queues.get(target)
        if queue is not None:
            queue.entries.pop(request_id, None)
            self._forget_if_idle(target, queue)

    def _forget_if_idle(self, target: Target, queue: _Queue) -> None:
        if not queue.entries and not queue.waiters:
            del self._queues[target]

    def _acknowledge(self, queue: _Queue, prev_cursor: int) -> None:
        entries = queue.entries
        while entries:
            request_id, first = next(iter(entries.items()))
            if first.cursor > prev_cursor:
                break
            del entries[request_id]
            self._where.pop(request_id, None)

    async def poll(self, target: Target, prev_cursor: int, timeout_s: float, limit: int,
                   gather_s: float = 0.0) -> tuple[list[Completion], int]:
        """The target's completions after `prev_cursor` (which acknowledges those before), at
        most `limit`, waiting up to `timeout_s` for one, then `gather_s` more for others that
        finish just after it (samples of one burst finish close together: one answer, not one
        each); and the cursor to send back next: the last one returned, or `prev_cursor` itself
        when none (a larger one would make the SDK send an acknowledgement for nothing)."""
        queue = self._queues.get(target)
        if queue is not None:
            self._acknowledge(queue, prev_cursor)
        if (queue is None or not queue.entries) and timeout_s > 0:
            if queue is None:
                queue = self._queues[target] = _Queue()
            queue.arrived.clear()
            queue.waiters += 1
            try:
                await asyncio.wait_for(queue.arrived.wait(), timeout_s)
                if gather_s > 0:
                    await asyncio.sleep(gather_s)
            except asyncio.TimeoutError:
                pass
            finally:
                queue.waiters -= 1
        if queue is None:
            return [], prev_cursor
        found = list(itertools.islice(queue.entries.values(), limit))
        if target in self._queues:
            self._forget_if_idle(target, queue)
        return found, (found[-1].cursor if found else prev_cursor)

    def queued(self) -> int:
        return len(self._where)
