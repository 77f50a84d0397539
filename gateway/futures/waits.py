"""Waiting for a future: the long-poll (retrieve_future, the OpenAI routes), whichever gateway
runs it."""

from __future__ import annotations

import asyncio
import time

from gateway.futures.record import FutureRecord
from gateway.storage.db import FutureRow, Status

POLL_S = 0.075             # a future running on another gateway: its row is read this often


class Waits:
    def __init__(self, futures):
        self.futures = futures               # gateway/futures/store.py Futures: what runs here, results

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
        if row.request_type == "sample":
            await self.futures.completions.fetched(request_id)     # no poll needs to report it
        return row

    async def _poll_row(self, row: FutureRow, deadline: float, owner: str) -> FutureRow:
        """Waits for a future another gateway runs by reading its row every POLL_S, until it
        finishes or `deadline`; if it comes to run here meanwhile (re-driven), waits for it here."""
        request_id = row.request_id
        while True:
            left = deadline - time.monotonic()
            if self.futures.here(request_id) is not None:
                return await self.wait(request_id, max(left, 0.0), owner)
            db = self.futures.db
            if await db.run(self.futures.store.status, request_id) != Status.PENDING:
                return await db.run(db.get, FutureRow, request_id)
            if left <= 0:
                return row
            await asyncio.sleep(min(POLL_S, left))

    def retrieved(self, request_ids: list[str], owner: str) -> None:
        """retrieve_futures' acknowledgement that the client has these payloads: they leave the
        memory cache (the futures table keeps them; their queue rows go in the poll's first look,
        Completions.poll). Unknown ids and other users' are skipped."""
        for request_id in request_ids:
            self.futures.drop_result(request_id, owner)
