"""Futures: every slow Tinker call becomes a row in the database plus a job run in the
background; `retrieve_future` long-polls on it. A finished sample is also queued for its sampling session's
retrieve_futures poll (gateway/futures/completions.py), and a pending one can be cancelled.

Any gateway on the database answers any future, and a killed gateway loses none:
- the row stores the request: its typed job (gateway/jobs/), as JSON arguments plus the serialized
  gRPC message (sparse inputs as the SDK sent them), until the future finishes; the submitted job
  runs as it is, and a re-driven one is decoded from that stored form (`job_of`);
- the gateway running a future holds a lease on its row (claimed_by, lease_until) and renews it
  every lease/3; a gateway claims pending rows whose lease lapsed (at start-up and every few
  seconds) and runs them again. The trainer answers a resent (model_id, seq_id) with its first
  result, so re-running a training request applies nothing twice; a sample is simply sampled
  again (its first result was never delivered);
- a future running elsewhere is waited for by polling its row (POLL_S).

Training jobs of one model run in seq_id order (gateway/futures/order.py); samples run concurrently.
Waiting for a future (the long-poll) is gateway/futures/waits.py.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import datetime
import logging
import os
import socket
import uuid
from typing import Mapping

import grpc
from google.protobuf.message import DecodeError

from gateway.errors import error_json
from gateway.futures.completions import Completions, Target
from gateway.futures.order import Job, ModelOrder
from gateway.futures.waits import Waits
from gateway import usage
from gateway.jobs.base import Done, Job as TypedJob, StoredRequest
from gateway.storage.db import Database, FutureRow, now
from gateway.tenant import TENANT
from gateway.traces.spans import Traces
from tinkerd.errors import ServiceError, UserError, category_for

log = logging.getLogger(__name__)

_FINISHED_KEPT = 4096      # recent results answered from memory; older ones from the database
_FINISHED_BYTES = 256 << 20   # ... and their bodies at most this in all (one sample's can be 100+ MB)


class FinishedResults:
    """Recently finished futures kept in memory, the oldest dropped first beyond `max_rows` rows
    or `max_bytes` of result bodies; a body larger than the budget is not kept at all. What is
    not here is read from the database."""

    def __init__(self, max_rows: int = _FINISHED_KEPT, max_bytes: int = _FINISHED_BYTES):
        self.max_rows, self.max_bytes = max_rows, max_bytes
        self._rows: collections.OrderedDict[str, FutureRow] = collections.OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, request_id: str) -> FutureRow | None:
        return self._rows.get(request_id)

    def put(self, row: FutureRow) -> None:
        self.pop(row.request_id)
        if len(row.result or b"") > self.max_bytes:
            return
        self._rows[row.request_id] = row
        self.bytes += len(row.result or b"")
        while len(self._rows) > self.max_rows or self.bytes > self.max_bytes:
            _, oldest = self._rows.popitem(last=False)
            self.bytes -= len(oldest.result or b"")

    def pop(self, request_id: str) -> None:
        row = self._rows.pop(request_id, None)
        if row is not None:
            self.bytes -= len(row.result or b"")

    def clear(self) -> None:
        self._rows.clear()
        self.bytes = 0


def new_request_id() -> str:
    return uuid.uuid4().hex


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


class Futures:
    def __init__(self, db: Database, lease_s: float = 10.0, traces: Traces | None = None):
        self.db = db
        self.lease_s = lease_s
        self.traces = traces or Traces(db)          # each session's request spans (gateway/traces/spans.py)
        # This process, as the owner of the futures it runs (unique across restarts and hosts).
        self.instance = f"{socket.gethostname()[:32]}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.gateway = None           # what jobs run with (gateway/state.py Gateway), set by bind()
        self.jobs: Mapping[str, type[TypedJob]] = {}     # request type -> its job class, set by bind()
        self.started_at = now()
        self._pending: dict[str, _Pending] = {}        # scheduled here, not finished yet
        self._finished = FinishedResults()
        self._pending_by_type: collections.Counter[str] = collections.Counter()
        self._pending_by_owner: collections.Counter[tuple[str, str]] = collections.Counter()
        # Training jobs, each model's in seq_id order (another gateway's seq counts as arrived).
        self.order = ModelOrder(self.run, self._elsewhere)
        self._submitting: collections.Counter[str] = collections.Counter()   # keys being recorded here, unscheduled
        self._jobs: dict[str, asyncio.Task] = {}       # unordered jobs (samples) still running
        self._cancelled: set[str] = set()              # finished by cancel(); their jobs still running
        self.completions = Completions(db)
        self.waits = Waits(self)
        self._stopping = False

    def bind(self, gateway, jobs: Mapping[str, type[TypedJob]]) -> None:
        """The runtime parts every job runs with (gateway/state.py), and the job of each request
        type (gateway/jobs/table.py)."""
        self.gateway, self.jobs = gateway, jobs

    async def _elsewhere(self, idempotency_key: str) -> bool:
        """Is this model request another gateway's? Its row exists, and it is not one this gateway
        is recording right now (about to be scheduled here)."""
        if idempotency_key in self._submitting:
            return False
        found = await self.db.run(self.db.future_type_by_key, idempotency_key) is not None
        return found and idempotency_key not in self._submitting

    def lease(self) -> datetime.datetime:
        return now() + datetime.timedelta(seconds=self.lease_s)

    def job_of(self, request_type: str, request: StoredRequest) -> Job | None:
        """A re-driven request's job, from its stored form. None if this gateway cannot run it
        (stored by an older one)."""
        job_class = self.jobs.get(request_type)
        try:
            job = job_class.from_stored(request) if job_class else None
        except (KeyError, TypeError, DecodeError):
            job = None
        return functools.partial(job.run, self.gateway) if job else None

    async def submit(self, job: TypedJob, *, owner: str, fingerprint: str | None = None,
                     idempotency_key: str | None = None, model_id: str | None = None, seq_id: int | None = None,
                     target: Target | None = None, request_id: str | None = None, admit=None) -> FutureRow:
        """Records the future, with its request, and schedules its job. A resend (same
        idempotency key and the same request) gets the first one back; the same key with a
        different request is a user error. A sample names its `target`, the sampling session
        (and clone) whose retrieve_futures poll reports it. `admit` checks the owner's limits
        with the new future counted (gateway/identity/limits.py) and raises to refuse it."""
        request_id, request_type, request = request_id or new_request_id(), job.kind(), job.stored()
        extra = {"seq_id": seq_id} if seq_id is not None else {}
        if target is not None:
            extra["target"] = list(target)
        self._submitting[idempotency_key] += 1
        try:
            row = await self.db.run(self.db.insert_future, FutureRow(
                request_id=request_id, idempotency_key=idempotency_key, fingerprint=fingerprint, owner=owner,
                request_type=request_type, model_id=model_id, extra=extra, request_args=request.args,
                request_body=request.body, claimed_by=self.instance, lease_until=self.lease()), admit)
        finally:      # scheduled below before anything else runs on the loop: it counts as here from now on
            self._submitting[idempotency_key] -= 1
            if not self._submitting[idempotency_key]:
                del self._submitting[idempotency_key]
        if row.request_id != request_id and (row.fingerprint != fingerprint or row.owner != owner):
            raise UserError(f"{idempotency_key.replace('#', ' seq_id ')} was already used for a different "
                            f"request ({row.request_type}); every request needs its own seq_id")
        if row.request_id != request_id or row.request_id in self._pending:
            if target is not None and row.status != "pending":    # reported again: the client may have missed it
                await self.db.run(self.completions.report_again, target, row.request_id, row.status == "failed",
                                  len(row.result or b""))
                self.completions.arrived(target)
            return row    # a resend: scheduled (here or on another gateway) or finished
        # The job in hand runs (its stored form is decoded only to re-drive it: tests/unit/test_jobs.py
        # keeps the two the same).
        self._schedule(row.request_id, request_type, functools.partial(job.run, self.gateway), owner, model_id,
                       seq_id, target)
        return row

    async def redrive(self, row: FutureRow) -> None:
        """Runs a claimed future of a gateway that died, from its stored request."""
        if row.request_id in self._pending:
            return
        job = None if row.request_args is None else self.job_of(
            row.request_type, StoredRequest(row.request_args, row.request_body or b""))
        if job is None:
            # Accepted by a gateway from before requests were stored as they are now: nothing to run again.
            await self.db.run(self.db.finish_future, row.request_id, "failed", "application/json", error_json(
                f"the gateway running this {row.request_type} request stopped before it finished and the "
                f"request cannot be run again here (it was accepted by an older gateway); send it again",
                "server"))
            return
        extra = row.extra or {}
        target = tuple(extra["target"]) if "target" in extra else None
        log.info("re-driving %s %s of a stopped gateway", row.request_type, row.request_id)
        self._schedule(row.request_id, row.request_type, job, row.owner, row.model_id, extra.get("seq_id"), target)

    def _schedule(self, request_id: str, request_type: str, job: Job, owner: str, model_id: str | None,
                  seq_id: int | None, target: Target | None) -> None:
        self._pending[request_id] = _Pending(asyncio.Event(), model_id, request_type, owner, target)
        self._pending_by_type[request_type] += 1
        self._pending_by_owner[owner, request_type] += 1
        self.traces.received(request_id, request_type, model_id, target[0] if target else None)
        if seq_id is not None and model_id is not None:
            self.order.put(model_id, seq_id, request_id, request_type, job)
        else:
            task = self._jobs[request_id] = asyncio.create_task(self.run(request_id, job))
            task.add_done_callback(functools.partial(self._job_ended, request_id, request_type, owner))

    async def keep_leases(self) -> None:
        """Renews the lease of every future running here, then claims and re-drives those whose
        gateway stopped renewing. Called every lease/3 (gateway/app.py), and at start-up."""
        await self.db.run(self.db.renew_leases, list(self._pending), self.instance, self.lease())
        for row in sorted(await self.db.run(self.db.claim_lapsed_futures, self.instance, self.lease()),
                          key=lambda r: (r.extra or {}).get("seq_id", 0)):
            await self.redrive(row)

    def stop(self) -> None:
        """A clean shutdown: the jobs running here stop unfinished and their leases are given up
        at once, so another gateway (or this one restarted) re-drives them without waiting."""
        self._stopping = True
        self.order.stop()
        for task in self._jobs.values():
            task.cancel()
        try:
            self.db.renew_leases(list(self._pending), self.instance, now())
        except Exception:  # noqa: BLE001 - then they are re-driven once the lease lapses
            log.exception("could not give up the leases of %d futures", len(self._pending))

    async def keep_leases_forever(self) -> None:
        while True:
            try:
                await self.keep_leases()
            except Exception:  # noqa: BLE001 - a database hiccup must not stop the renewals
                log.exception("could not renew or claim futures")
            await asyncio.sleep(self.lease_s / 3)

    async def run(self, request_id: str, job: Job) -> None:
        pending = self._pending.get(request_id)
        tenant = TENANT.set(pending.owner if pending is not None else "")     # whom its trainer calls are for
        self.traces.started(request_id)
        work = None
        try:
            done = await job()
            content_type, body, status = done[0], done[1], "complete"
            work = done.usage if isinstance(done, Done) else None
        except ServiceError as e:
            status, content_type, body = "failed", "application/json", error_json(str(e), category_for(e.code))
        except grpc.aio.AioRpcError as e:
            status, content_type = "failed", "application/json"
            body = error_json(e.details() or e.code().name, category_for(e.code()))
        except Exception as e:  # noqa: BLE001 - a failed job must still finish its future
            log.exception("job %s failed", request_id)
            status, content_type, body = "failed", "application/json", error_json(f"{type(e).__name__}: {e}", "server")
        finally:
            TENANT.reset(tenant)
        if self._stopping:      # shutting down (the call was cut short): it is re-driven, not failed
            return
        if request_id in self._pending:       # else cancel() finished it already: the result is dropped
            await self._finish(request_id, status, content_type, body, work)

    async def _finish(self, request_id: str, status: str, content_type: str, body: bytes, work=None) -> None:
        pending = self._pending.pop(request_id)
        # An unordered job releases its place when its task ends (_job_ended), which a cancel() may
        # make happen while the row is written: decided now.
        release_here = request_id not in self._jobs
        self.traces.finished(request_id, "cancelled" if request_id in self._cancelled else status)
        completion = None if pending.target is None else Completions.row(pending.target, status == "failed", len(body))
        added: list[bool] = []
        also = None if work is None else (lambda conn: added.append(usage.add(conn, work)))
        if await self.db.run(self.db.finish_future, request_id, status, content_type, body, completion, also):
            if any(added):
                usage.counted(work)
            row = FutureRow(request_id=request_id, status=status, content_type=content_type, result=body,
                            owner=pending.owner, request_type=pending.request_type)
            if pending.target is not None:
                self.completions.arrived(pending.target)
        else:      # finished elsewhere first (cancelled there, or re-driven by a gateway that thought us dead)
            row = await self.db.run(self.db.get, FutureRow, request_id)
        self._finished.put(row)
        if release_here:
            self._release(pending.request_type, pending.owner)
        pending.done.set()

    def _release(self, request_type: str, owner: str) -> None:
        self._pending_by_type[request_type] -= 1
        self._pending_by_owner[owner, request_type] -= 1

    def _job_ended(self, request_id: str, request_type: str, owner: str, _task: asyncio.Task) -> None:
        """A sample's place in this gateway's counts (gateway/metrics.py) is freed when its job's
        task ends; a cancelled one's task is cancelled with it (cancel()). The limits count the
        database instead (gateway/identity/limits.py), where a cancelled sample is finished at once."""
        del self._jobs[request_id]
        self._cancelled.discard(request_id)
        self._release(request_type, owner)

    async def cancel(self, request_id: str, owner: str) -> Cancelled | None:
        """cancel_future: the owner's pending sample finishes at once as cancelled (a user
        error for whoever retrieves it) and its job's task is cancelled, which cancels the gRPC call
        (the sampler aborts the generation in vLLM). A sample running on another gateway is
        finished as cancelled in the database; that gateway's result is then dropped. A finished
        future is left as it is. None if unknown (or another user's)."""
        pending = self._pending.get(request_id)
        if pending is None:
            row = await self.finished_row(request_id)
            if row is None or row.owner != owner:
                return None
            if row.status == "pending" and row.request_type == "sample":    # running on another gateway
                body = _cancelled_body(request_id)
                target = (row.extra or {}).get("target")
                completion = Completions.row(tuple(target), True, len(body)) if target else None
                if await self.db.run(self.db.finish_future, request_id, "failed", "application/json", body,
                                     completion):
                    return Cancelled(True, "cancelled")
                row = await self.db.run(self.db.get, FutureRow, request_id)
            elif row.status == "pending":
                raise UserError(_not_cancellable(request_id, row.request_type))
            return Cancelled(False, "cancelled" if request_id in self._cancelled else row.status)
        if pending.owner != owner:
            return None
        if pending.request_type != "sample":
            raise UserError(_not_cancellable(request_id, pending.request_type))
        self._cancelled.add(request_id)
        if request_id in self._jobs:     # cancels its gRPC call: the sampler aborts the generation
            self._jobs[request_id].cancel()
        await self._finish(request_id, "failed", "application/json", _cancelled_body(request_id))
        return Cancelled(True, "cancelled")

    def here(self, request_id: str) -> "_Pending | None":
        """The future, if it is scheduled on this gateway and not finished."""
        return self._pending.get(request_id)

    async def finished_row(self, request_id: str) -> FutureRow | None:
        """A finished future's row: from this gateway's recent results, else the database."""
        return self._finished.get(request_id) or await self.db.run(self.db.get, FutureRow, request_id)

    def drop_result(self, request_id: str, owner: str) -> None:
        """The client has this result: it leaves the memory cache (the futures table keeps it)."""
        row = self._finished.get(request_id)
        if row is not None and row.owner == owner:
            self._finished.pop(request_id)

    def pending_of(self, owner: str, request_type: str | None = None) -> int:
        """The owner's futures scheduled here and not finished yet (of one type, or all): this
        gateway's share, for its metrics; the limits count every gateway's (Database.pending_*)."""
        if request_type is None:
            return sum(n for (o, _), n in self._pending_by_owner.items() if o == owner)
        return self._pending_by_owner[owner, request_type]

    def owners_pending(self) -> list[str]:
        """Users with futures scheduled here and not finished yet (gateway/metrics.py)."""
        return sorted({owner for (owner, _), n in self._pending_by_owner.items() if n > 0})

    def pending(self, request_type: str) -> int:
        """Futures of this type scheduled here and not finished yet."""
        return self._pending_by_type[request_type]

    async def drained(self, model_id: str) -> None:
        """Returns once every future of this model scheduled so far has finished."""
        waits = [p.done.wait() for p in self._pending.values() if p.model_id == model_id]
        if waits:
            await asyncio.gather(*waits)


def _cancelled_body(request_id: str) -> bytes:
    return error_json(f"sample request {request_id} was cancelled (cancel_future) before it finished", "user")


def _not_cancellable(request_id: str, request_type: str) -> str:
    return (f"request {request_id} is a {request_type} request; only samples can be cancelled (a training "
            f"run's requests all run, in seq_id order)")
