"""Waiting for a future: the long-poll (retrieve_future, the OpenAI routes), whichever gateway
runs it."""

from __future__ import annotations

import asyncio
import time

from gateway.futures.peers import NET_S
from gateway.futures.record import FutureRecord
from gateway.storage.db import FutureRow, Status

POLL_S = 0.075             # a future running on another gateway: its row is read this often, unless
                           # the other gateways' messages are heard (then every NET_S, as a net)


class Waits:
    def __init__(self, futures):
        self.futures = futures               # gateway/futures/store.py Futures: what runs here, results
        self._elsewhere: dict[str, list[asyncio.Event]] = {}     # waits for futures of other gateways

    async def wait(self, request_id: str, timeout_s: float, owner: str) -> FutureRow | None:
        """The owner's future once finished, or still pending after `timeout_s`; None if unknown
        (or another user's)."""
        pending = self.futures.here(request_id)
        if pending is not None:
            if pending.owner != owner:
                return None
            try:
                await asyncio.wait_for(pending.done.wait(), timeout_s)
            except asyncio.TimeoutError:
                return FutureRecord(request_id=request_id, status=Status.PENDING, model_id=pending.model_id)
        row = await self.futures.finished_row(request_id)
        if row is None or row.owner != owner:
            return None
        if row.status == Status.PENDING:       # running on another gateway, or waiting to be re-driven
            row = await self._poll_row(row, time.monotonic() + timeout_s, owner)
            if row.status == Status.PENDING:
                return row
        target = (row.extra or {}).get("target")
        if target is not None:               # a sample of a sampling session (the OpenAI routes' have none)
            self.futures.completions.fetched(request_id, tuple(target))     # no poll needs to report it
        return row

    async def _poll_row(self, row: FutureRow, deadline: float, owner: str) -> FutureRow:
        """Waits for a future another gateway runs, until its message says it finished (read
        then), or `deadline`; its row is read every POLL_S (NET_S while messages are heard) in
        case a message is lost. If it comes to run here meanwhile (re-driven: `wake`), waits for
        it here."""
        request_id = row.request_id
        finished = asyncio.Event()
        self._elsewhere.setdefault(request_id, []).append(finished)     # before the read: none missed
        try:
            while True:
                finished.clear()
                left = deadline - time.monotonic()
                if self.futures.here(request_id) is not None:
                    return await self.wait(request_id, max(left, 0.0), owner)
                db = self.futures.db
                if await db.run(self.futures.store.status, request_id) != Status.PENDING:
                    return await db.run(self.futures.store.get, request_id)
                if left <= 0:
                    return row
                period = NET_S if self.futures.peers.listening else POLL_S
                try:
                    await asyncio.wait_for(finished.wait(), min(period, left))
                except asyncio.TimeoutError:
                    pass
        finally:
            waiting = self._elsewhere[request_id]
            waiting.remove(finished)
            if not waiting:
                del self._elsewhere[request_id]

    def wake(self, request_id: str) -> None:
        """`request_id` finished on another gateway (its message), or came to run here."""
        for finished in self._elsewhere.get(request_id, ()):
            finished.set()

    def retrieved(self, request_ids: list[str], owner: str) -> None:
        """retrieve_futures' acknowledgement that the client has these payloads: they leave the
        memory cache (the futures table keeps them; their queue rows go in the poll's first look,
        Completions.poll). Unknown ids and other users' are skipped."""
        for request_id in request_ids:
            self.futures.drop_result(request_id, owner)
