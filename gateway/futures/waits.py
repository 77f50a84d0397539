"""Waiting for a future: the long-poll (retrieve_future, the OpenAI routes), whichever gateway
runs it, and a restarted client's recovery of the samples an earlier gateway process never reported
(retrieve_futures)."""

from __future__ import annotations

import asyncio
import collections
import datetime
import time

from sqlalchemy import select

from gateway.futures.completions import Target
from gateway.protocol import SAMPLING_CLONE_SPAN
from gateway.storage.db import FutureRow, now

POLL_S = 0.075             # a future running on another gateway: its row is read this often
_RECOVER_WINDOW_S = 600.0  # a restarted gateway re-reports samples finished this recently
_RECOVERED_KEPT = 4096     # sampling sessions recovered already (bounded memory)


class Waits:
    def __init__(self, futures):
        self.futures = futures               # gateway/futures/store.py Futures: what runs here, results
        self._recovered: collections.OrderedDict[Target, None] = collections.OrderedDict()
        self._watched: set[str] = set()      # other gateways' samples a poller here waits for

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
                return FutureRow(request_id=request_id, status="pending", model_id=pending.model_id)
        row = self.futures.finished_row(request_id)
        if row is None or row.owner != owner:
            return None
        if row.status == "pending":       # running on another gateway, or waiting to be re-driven
            row = await self._poll_row(row, time.monotonic() + timeout_s, owner)
            if row.status == "pending":
                return row
        self.futures.completions.discard(request_id)      # the client has it: no poll needs to report it
        return row

    async def _poll_row(self, row: FutureRow, deadline: float, owner: str) -> FutureRow:
        """Waits for a future another gateway runs by reading its row every POLL_S, until it
        finishes or `deadline`; if it comes to run here meanwhile (re-driven), waits for it here."""
        request_id = row.request_id
        while True:
            left = deadline - time.monotonic()
            if self.futures.here(request_id) is not None:
                return await self.wait(request_id, max(left, 0.0), owner)
            if self.futures.db.future_status(request_id) != "pending":
                return self.futures.db.get(FutureRow, request_id)
            if left <= 0:
                return row
            await asyncio.sleep(min(POLL_S, left))

    def retrieved(self, request_id: str, owner: str, target: Target) -> None:
        """retrieve_futures' acknowledgement that the client has this payload: it leaves the
        owner's `target` queue and the memory cache (the futures table keeps it). Unknown ids and
        other users' are skipped."""
        self.futures.completions.discard(request_id, target)
        self.futures.drop_result(request_id, owner)

    def recover(self, target: Target, owner: str, prev_cursor: int) -> None:
        """A client that polled an earlier gateway process (its cursor is older than this one)
        may wait for samples that process never finished. Those were re-driven (here or on
        another gateway): queue each once it finishes, so this poll reports it. Samples that
        finished lately are queued again too, in case the earlier process died before reporting
        them (the SDK ignores completions it does not wait for)."""
        if not 0 < prev_cursor < self.futures.completions.started or target in self._recovered:
            return
        self._recovered[target] = None
        while len(self._recovered) > _RECOVERED_KEPT:
            self._recovered.popitem(last=False)
        sampling_session_id, clone = target
        prefix = sampling_session_id.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "#"
        recent = now() - datetime.timedelta(seconds=_RECOVER_WINDOW_S)
        rows = self.futures.db.select(select(FutureRow).where(
            FutureRow.idempotency_key.like(prefix + "%", escape="\\"), FutureRow.owner == owner,
            FutureRow.created_at < self.futures.started_at,
            (FutureRow.status == "pending") | (FutureRow.completed_at >= recent)))
        for row in rows:
            if int(row.idempotency_key.rpartition("#")[2]) // SAMPLING_CLONE_SPAN != clone:
                continue
            if row.status != "pending":
                self.futures.completions.add(target, row.request_id, row.status == "failed", len(row.result or b""))
            elif self.futures.here(row.request_id) is None and row.request_id not in self._watched:
                self._watched.add(row.request_id)      # running elsewhere: report it when it ends
                self.futures.gateway.in_background(self._report_when_done(target, row, owner))

    async def _report_when_done(self, target: Target, row: FutureRow, owner: str) -> None:
        try:
            while row.status == "pending":
                row = await self._poll_row(row, time.monotonic() + 60.0, owner)
            self.futures.completions.add(target, row.request_id, row.status == "failed", len(row.result or b""))
        finally:
            self._watched.discard(row.request_id)
