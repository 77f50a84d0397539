"""Futures: every slow Tinker call becomes a row in the database plus a job run in the
background; `retrieve_future` long-polls on it. A finished sample is also queued for its sampling session's
retrieve_futures poll (gateway/completions.py), and a pending one can be cancelled.

Training jobs of one model run strictly in seq_id order (the SDK posts chunks of one call
concurrently, first chunk last): a per-model runner holds back a request until every lower
seq_id has run, waiting a bounded time for a gap to fill. Samples run concurrently.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import hashlib
import heapq
import json
import logging
import uuid
from typing import Awaitable, Callable

import grpc
from sqlalchemy import select

from gateway.completions import Completions, Target
from gateway.db import Database, FutureRow, now
from gateway.protocol import SAMPLING_CLONE_SPAN
from gateway.errors import error_json
from tinkerd.errors import ServiceError, UserError, category_for

log = logging.getLogger(__name__)

Job = Callable[[], Awaitable[tuple[str, bytes]]]   # -> (content_type, body)
GAP_TIMEOUT_S = 10.0
_FINISHED_KEPT = 4096      # recent results answered from memory; older ones from the database


def fingerprint(kind: str, request: bytes | str) -> str:
    """What identifies a request's content, to tell a resend from another request."""
    data = request.encode() if isinstance(request, str) else request
    return hashlib.sha256(kind.encode() + b"\0" + data).hexdigest()


def json_body(obj) -> tuple[str, bytes]:
    return "application/json", json.dumps(obj).encode()


@dataclasses.dataclass
class _Pending:
    done: asyncio.Event
    model_id: str | None
    request_type: str
    owner: str
    target: Target | None = None          # a sample's: where retrieve_futures reports it


@dataclasses.dataclass
class Cancelled:
    """What cancel() did: `cancelled` if this call cancelled the future; `status` is its state now."""
    cancelled: bool
    status: str


class _ModelRunner:
    """Runs one model's jobs in seq_id order."""

    def __init__(self, futures: "Futures", next_seq: int):
        self.futures = futures
        self.next_seq = next_seq
        self.heap: list[tuple[int, str, Job]] = []
        self.running: str | None = None
        self.arrived = asyncio.Event()
        self.task = asyncio.create_task(self._loop())

    def put(self, seq: int, request_id: str, job: Job) -> None:
        heapq.heappush(self.heap, (seq, request_id, job))
        self.arrived.set()

    async def _loop(self) -> None:
        while True:
            if not self.heap:
                self.arrived.clear()
                await self.arrived.wait()
                continue
            if self.heap[0][0] > self.next_seq:
                self.arrived.clear()
                try:
                    await asyncio.wait_for(self.arrived.wait(), GAP_TIMEOUT_S)
                    continue          # something arrived: re-check the head
                except asyncio.TimeoutError:
                    log.warning("seq %d never arrived; running seq %d", self.next_seq, self.heap[0][0])
            seq, request_id, job = heapq.heappop(self.heap)
            self.next_seq = max(self.next_seq, seq + 1)
            self.running = request_id
            try:
                await self.futures.run(request_id, job)
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


class Futures:
    def __init__(self, db: Database):
        self.db = db
        self.started_at = now()       # before the start-up sweep of an earlier process's futures (gateway/app.py)
        self._pending: dict[str, _Pending] = {}        # scheduled here, not finished yet
        self._finished: collections.OrderedDict[str, FutureRow] = collections.OrderedDict()
        self._pending_by_type: collections.Counter[str] = collections.Counter()
        self._pending_by_owner: collections.Counter[tuple[str, str]] = collections.Counter()
        self._runners: dict[str, _ModelRunner] = {}
        self._jobs: dict[str, asyncio.Task] = {}       # unordered jobs (samples) still running
        self._cancelled: set[str] = set()              # finished by cancel(); their jobs still running
        self.completions = Completions()
        self._recovered: set[Target] = set()           # targets whose restart orphans were queued

    def submit(self, request_type: str, job: Job, *, owner: str, fingerprint: str | None = None,
               idempotency_key: str | None = None, model_id: str | None = None, seq_id: int | None = None,
               extra: dict | None = None, target: Target | None = None) -> FutureRow:
        """Records the future and schedules its job. A resend (same idempotency key and the same
        request) gets the first one back; the same key with a different request is a user error.
        A sample names its `target`, the sampling session (and clone) whose retrieve_futures poll
        reports it."""
        request_id = uuid.uuid4().hex
        row = self.db.insert_future(FutureRow(request_id=request_id, idempotency_key=idempotency_key,
                                              fingerprint=fingerprint, owner=owner, request_type=request_type,
                                              model_id=model_id, extra=extra or {}))
        if row.request_id != request_id and (row.fingerprint != fingerprint or row.owner != owner):
            raise UserError(f"{idempotency_key.replace('#', ' seq_id ')} was already used for a different "
                            f"request ({row.request_type}); every request needs its own seq_id")
        if row.request_id in self._pending or row.status != "pending":
            if target is not None and row.status != "pending":    # reported again: the client may have missed it
                self.completions.add(target, row.request_id, row.status == "failed", len(row.result or b""))
            return row    # a resend: already scheduled or finished
        self._pending[row.request_id] = _Pending(asyncio.Event(), model_id, request_type, owner, target)
        self._pending_by_type[request_type] += 1
        self._pending_by_owner[owner, request_type] += 1
        if seq_id is not None and model_id is not None:
            runner = self._runners.get(model_id)
            if runner is None:
                runner = self._runners[model_id] = _ModelRunner(self, next_seq=seq_id)
            runner.put(seq_id, row.request_id, job)
        else:
            task = self._jobs[row.request_id] = asyncio.create_task(self.run(row.request_id, job))
            task.add_done_callback(functools.partial(self._job_ended, row.request_id, request_type, owner))
        return row

    async def run(self, request_id: str, job: Job) -> None:
        try:
            content_type, body = await job()
            status = "complete"
        except ServiceError as e:
            status, content_type, body = "failed", "application/json", error_json(str(e), category_for(e.code))
        except grpc.aio.AioRpcError as e:
            status, content_type = "failed", "application/json"
            body = error_json(e.details() or e.code().name, category_for(e.code()))
        except Exception as e:  # noqa: BLE001 - a failed job must still finish its future
            log.exception("job %s failed", request_id)
            status, content_type, body = "failed", "application/json", error_json(f"{type(e).__name__}: {e}", "server")
        if request_id in self._pending:       # else cancel() finished it already: the result is dropped
            self._finish(request_id, status, content_type, body)

    def _finish(self, request_id: str, status: str, content_type: str, body: bytes) -> None:
        pending = self._pending.pop(request_id)
        self.db.finish_future(request_id, status, content_type, body)
        self._finished[request_id] = FutureRow(request_id=request_id, status=status, content_type=content_type,
                                               result=body, owner=pending.owner)
        while len(self._finished) > _FINISHED_KEPT:
            self._finished.popitem(last=False)
        if request_id not in self._jobs:      # an unordered job releases its place when its task ends
            self._release(pending.request_type, pending.owner)
        if pending.target is not None:
            self.completions.add(pending.target, request_id, status == "failed", len(body))
        pending.done.set()

    def _release(self, request_type: str, owner: str) -> None:
        self._pending_by_type[request_type] -= 1
        self._pending_by_owner[owner, request_type] -= 1

    def _job_ended(self, request_id: str, request_type: str, owner: str, _task: asyncio.Task) -> None:
        """A cancelled sample keeps its place in the limits (gateway/limits.py) until its job has
        really ended: the sampler does the work either way."""
        del self._jobs[request_id]
        self._cancelled.discard(request_id)
        self._release(request_type, owner)

    def cancel(self, request_id: str, owner: str) -> Cancelled | None:
        """cancel_future: the owner's pending sample finishes at once as cancelled (a user
        error for whoever retrieves it); its job runs out unwatched, its result dropped. A finished
        future is left as it is. None if unknown (or another user's)."""
        pending = self._pending.get(request_id)
        if pending is None:
            row = self._finished.get(request_id) or self.db.get(FutureRow, request_id)
            if row is None or row.owner != owner:
                return None
            return Cancelled(False, "cancelled" if request_id in self._cancelled else row.status)
        if pending.owner != owner:
            return None
        if pending.request_type != "sample":
            raise UserError(f"request {request_id} is a {pending.request_type} request; only samples can be "
                            f"cancelled (a training run's requests all run, in seq_id order)")
        self._cancelled.add(request_id)
        if request_id in self._jobs:     # cancels its gRPC call: the sampler aborts the generation
            self._jobs[request_id].cancel()
        self._finish(request_id, "failed", "application/json",
                     error_json(f"sample request {request_id} was cancelled (cancel_future) before it finished",
                                "user"))
        return Cancelled(True, "cancelled")

    async def wait(self, request_id: str, timeout_s: float, owner: str) -> FutureRow | None:
        """The owner's future once finished, or still pending after `timeout_s`; None if unknown
        (or another user's)."""
        pending = self._pending.get(request_id)
        if pending is not None:
            if pending.owner != owner:
                return None
            try:
                await asyncio.wait_for(pending.done.wait(), timeout_s)
            except asyncio.TimeoutError:
                return FutureRow(request_id=request_id, status="pending", model_id=pending.model_id)
        row = self._finished.get(request_id) or self.db.get(FutureRow, request_id)
        if row is None or row.owner != owner:
            return None
        self.completions.discard(request_id)      # the client has it: no poll needs to report it
        return row

    def retrieved(self, request_id: str, owner: str, target: Target) -> None:
        """retrieve_futures' acknowledgement that the client has this payload: it leaves the
        owner's `target` queue and the memory cache (the futures table keeps it). Unknown ids and
        other users' are skipped."""
        self.completions.discard(request_id, target)
        row = self._finished.get(request_id)
        if row is not None and row.owner == owner:
            del self._finished[request_id]

    def recover_orphans(self, target: Target, owner: str, prev_cursor: int) -> None:
        """A client that polled an earlier gateway process (its cursor is older than this one)
        may wait for samples that process never finished; they were failed at start-up
        (Database.fail_orphaned_futures): queue them once, so its poll reports them failed rather
        than never."""
        if not 0 < prev_cursor < self.completions.started or target in self._recovered:
            return
        self._recovered.add(target)
        sampling_session_id, clone = target
        prefix = sampling_session_id.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "#"
        rows = self.db.select(select(FutureRow).where(
            FutureRow.idempotency_key.like(prefix + "%", escape="\\"), FutureRow.owner == owner,
            FutureRow.status == "failed", FutureRow.completed_at >= self.started_at))
        for row in rows:
            if int(row.idempotency_key.rpartition("#")[2]) // SAMPLING_CLONE_SPAN == clone:
                self.completions.add(target, row.request_id, True, len(row.result or b""))

    def pending_of(self, owner: str, request_type: str | None = None) -> int:
        """The owner's futures scheduled here and not finished yet (of one type, or all)."""
        if request_type is None:
            return sum(n for (o, _), n in self._pending_by_owner.items() if o == owner)
        return self._pending_by_owner[owner, request_type]

    def owners_pending(self) -> list[str]:
        """Users with futures scheduled here and not finished yet (gateway/metrics.py)."""
        return sorted({owner for (owner, _), n in self._pending_by_owner.items() if n > 0})

    def pending(self, request_type: str) -> int:
        """Futures of this type scheduled here and not finished yet."""
        return self._pending_by_type[request_type]

    def position(self, model_id: str | None, request_id: str) -> tuple[bool, int]:
        """(running now, requests of the same model ahead of it) for a pending training future."""
        runner = self._runners.get(model_id or "")
        ahead = runner.ahead_of(request_id) if runner else None
        return (runner is not None and runner.running == request_id), (ahead or 0)

    async def drained(self, model_id: str) -> None:
        """Returns once every future of this model scheduled so far has finished."""
        waits = [p.done.wait() for p in self._pending.values() if p.model_id == model_id]
        if waits:
            await asyncio.gather(*waits)

    def forget_runner(self, model_id: str) -> None:
        runner = self._runners.pop(model_id, None)
        if runner:
            runner.task.cancel()
