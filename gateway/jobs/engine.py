"""What the routes hand work to: one `submit` for every request that becomes a future (the shape of
vLLM's EngineClient). A route checks and translates its body, makes the typed job
(gateway/jobs/) and submits it here: its future is recorded (gateway/futures/store.py) and the job
in hand runs in a task of its own, a model's request once its turn in the model's seq_id order
comes (gateway/futures/order.py). Its stored form is decoded only when another gateway's future
is re-driven here (`redrive`).

A model's request (a `seq_id`) is counted against its owner's training queue; others (samples,
custom losses, no-ops) run as they come, admitted by what the route names (`admit`:
gateway/identity/limits.py). A model's request refused by its route still takes its turn
(`refuse`), so the model's next request waits for nobody.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import typing
from typing import Awaitable, Callable, Mapping

import grpc
from google.protobuf.message import DecodeError

from gateway.errors import error_json
from gateway.futures.order import ModelOrder
from gateway.futures.record import FutureRecord
from gateway.identity.caller import Caller
from gateway.jobs.base import Done, Job, StoredRequest
from gateway.jobs.context import JobContext
from gateway.jobs.refused import Refused
from gateway.storage.db import Database, FutureRow, ModelRow, Status, aware, now
from gateway.tenant import TENANT
from gateway.traces.spans import session_of
from tinkerd.errors import ServiceError, category_for
from tinkerd.v1 import trainer_pb2

if typing.TYPE_CHECKING:         # the parts it is built from (gateway/app.py builds it)
    from sqlalchemy.engine import Connection

    from gateway.futures.completions import Target
    from gateway.futures.store import Cancelled, Futures
    from gateway.identity.limits import Limits
    from gateway.settings import GatewaySettings

log = logging.getLogger(__name__)

Run = Callable[[], Awaitable[tuple[str, bytes]]]      # a job bound to what it runs with

# A model's last_request_time is written at most this often (one write per request is too many).
_REQUEST_TIME_RESOLUTION_S = 5.0


def fingerprint(kind: str, request: bytes | str) -> str:
    """What identifies a request's content, to tell a resend from another request."""
    data = request.encode() if isinstance(request, str) else request
    return hashlib.sha256(kind.encode() + b"\0" + data).hexdigest()


class Jobs:
    def __init__(self, futures: "Futures", limits: "Limits", db: Database, settings: "GatewaySettings",
                 table: Mapping[str, type[Job]]):
        """`table`: the job class of each request type (gateway/jobs/table.py), by which a stored
        future is run again."""
        self.futures, self.limits, self.db, self.settings = futures, limits, db, settings
        self.table = table
        # What every job's `run` is handed: set at startup (gateway/app.py), once the backends exist.
        self.context: JobContext | None = None
        self.order = ModelOrder(futures.elsewhere, self._gap_waited)
        self._tasks: dict[str, asyncio.Task] = {}       # each job started here and still running

    def _gap_waited(self, model_id: str, lo: int, hi: int) -> None:
        """seq_id `lo` of the model never came, here or to another gateway, and was waited out
        before `hi` started: the trainer is told (SkipSeq through_seq_id), so that `hi` does not
        wait out the gap a second time there. Unanswered, the trainer waits it out itself."""
        if self.context is not None:
            self.context.in_background(self._tell_gap(model_id, lo, hi))

    async def _tell_gap(self, model_id: str, lo: int, hi: int) -> None:
        try:
            # Up to the first seq_id another gateway holds in the gap (only `lo` was asked about):
            # the trainer must wait for that one, not skip it.
            held = await self.db.run(self.futures.store.first_pending_seq, model_id, lo, hi)
            await self.context.trainer.SkipSeq(trainer_pb2.SkipSeqRequest(
                model_id=model_id, seq_id=lo, through_seq_id=hi if held is None else held))
        except Exception as e:  # noqa: BLE001 - the trainer's own gap timeout covers it
            log.warning("could not tell the trainer of a gap waited out: %s", e)

    async def submit(self, job: Job, caller: Caller, *, model_id: str | None = None, seq_id: int | None = None,
                     fingerprint: str | None = None, idempotency_key: str | None = None,
                     target: "Target | None" = None, request_id: str | None = None,
                     admit: "Callable[[Connection], None] | None" = None) -> FutureRecord | FutureRow:
        """The job's future (a resend, same key and same `fingerprint`, gets the first one back)."""
        ordered = seq_id is not None
        if ordered:
            idempotency_key = f"{model_id}#{seq_id}"
            admit = admit or self.limits.admit_training(caller, job.kind(), model_id)
        refusals = self.futures.traces.refusals(session_of(model_id, None), job.kind()) if ordered else \
            contextlib.nullcontext()
        with refusals:       # a model's 429 is in its session's trace
            row, new = await self.futures.record(job, owner=caller.user_id, fingerprint=fingerprint,
                                                 idempotency_key=idempotency_key, model_id=model_id, seq_id=seq_id,
                                                 target=target, request_id=request_id, admit=admit)
        if new:
            self._start(row.request_id, job.kind(), job, caller.user_id, model_id, seq_id, target)
        if ordered:
            cached = self.db.cached(ModelRow, model_id)      # read on the loop only from memory
            if cached is None or self._marks(cached):
                await self.db.run(self._used, model_id)
        return row

    async def refuse(self, caller: Caller, model_id: str, seq_id: int, error: str) -> None:
        """The model's seq_id is taken by a refusal (jobs/training.py Refused). A resend of it gets
        the first one back; a seq_id another request holds needs no record."""
        job = Refused(model_id, seq_id, error)
        try:
            row, new = await self.futures.record(job, owner=caller.user_id, fingerprint=fingerprint("refused", error),
                                                 idempotency_key=f"{model_id}#{seq_id}", model_id=model_id,
                                                 seq_id=seq_id)
        except ServiceError:
            return
        if new:
            self._start(row.request_id, job.kind(), job, caller.user_id, model_id, seq_id, None)

    async def redrive(self, row: FutureRow) -> None:
        """Runs a claimed future of a gateway that stopped, from its stored request."""
        job_class = self.table.get(row.request_type)
        try:
            job = None if row.request_args is None or job_class is None else job_class.from_stored(
                StoredRequest(row.request_args, row.request_body or b""))
        except (KeyError, TypeError, DecodeError):
            job = None
        if job is None:         # accepted by a gateway from before requests were stored as they are now
            await self.futures.fail_unrunnable(row)
            return
        extra = row.extra or {}
        log.info("re-driving %s %s of a stopped gateway", row.request_type, row.request_id)
        self._start(row.request_id, row.request_type, job, row.owner, row.model_id, extra.get("seq_id"),
                    tuple(extra["target"]) if "target" in extra else None)

    def _start(self, request_id: str, request_type: str, job: Job, owner: str, model_id: str | None,
               seq_id: int | None, target: "Target | None") -> None:
        """The job's task, started before anything else runs on the loop; a model's request takes
        its turn now (it may run at once)."""
        run = functools.partial(job.run, self.context)      # a partial: no frame of ours between task and job
        self.futures.started(request_id, request_type, owner, model_id, target)
        turn = self.order.put(model_id, seq_id, request_id, request_type) if seq_id is not None and \
            model_id is not None else contextlib.nullcontext()
        task = self._tasks[request_id] = asyncio.create_task(self._execute(request_id, run, turn, owner))
        task.add_done_callback(functools.partial(self._ended, request_id, request_type, owner))

    async def _execute(self, request_id: str, run: Run, turn, owner: str) -> None:
        async with turn:
            tenant = TENANT.set(owner)          # whom its trainer calls are for
            self.futures.traces.started(request_id)
            work = records = None
            try:
                done = await run()
                content_type, body, status = done[0], done[1], Status.COMPLETE
                if isinstance(done, Done):
                    work, records = done.usage, done.records
            except ServiceError as e:
                status, content_type, body = Status.FAILED, "application/json", error_json(str(e), category_for(e.code))
            except grpc.aio.AioRpcError as e:
                status, content_type = Status.FAILED, "application/json"
                body = error_json(e.details() or e.code().name, category_for(e.code()))
            except Exception as e:  # noqa: BLE001 - a failed job must still finish its future
                log.exception("job %s failed", request_id)
                status, content_type, body = Status.FAILED, "application/json", error_json(f"{type(e).__name__}: {e}",
                                                                                    "server")
            finally:
                TENANT.reset(tenant)
            if self.futures.stopping:      # shutting down (the call was cut short): it is re-driven, not failed
                return
            await self.futures.finish(request_id, status, content_type, body, work, records)

    def _ended(self, request_id: str, request_type: str, owner: str, _task: asyncio.Task) -> None:
        del self._tasks[request_id]
        self.futures.ended(request_id, request_type, owner)

    async def cancel(self, request_id: str, owner: str) -> "Cancelled | None":
        """cancel_future (gateway/futures/store.py Futures.cancel); a sample running here has its task
        cancelled, which cancels its gRPC call: the sampler aborts the generation."""
        cancelled = await self.futures.cancel(request_id, owner)
        if cancelled is not None and cancelled.cancelled and request_id in self._tasks:
            self._tasks[request_id].cancel()
        return cancelled

    async def keep_leases_forever(self) -> None:
        """Renews the leases of the futures running here and re-drives the ones of gateways that
        stopped renewing theirs, every lease/3 from start-up."""
        while True:
            try:
                for row in await self.futures.keep_leases():
                    await self.redrive(row)
            except Exception:  # noqa: BLE001 - a database hiccup must not stop the renewals
                log.exception("could not renew or claim futures")
            await asyncio.sleep(self.futures.lease_s / 3)

    def stop(self) -> None:
        """A clean shutdown: the jobs running here stop unfinished and their leases are given up."""
        self.order.stop()
        for task in self._tasks.values():
            task.cancel()
        self.futures.give_up_leases()

    def _marks(self, model: ModelRow) -> bool:
        """Whether a request now marks the model used: it is not resident, or its request time is
        older than the resolution (5 s, or a third of the session timeout if shorter)."""
        resolution = min(_REQUEST_TIME_RESOLUTION_S, self.settings.session_timeout_s / 3)
        return not model.resident or (now() - aware(model.last_request_time)).total_seconds() > resolution

    def _used(self, model_id: str) -> None:
        """The model is in use: it is not unloaded as idle (finer than the session timeout:
        db.models_of_lapsed_sessions), and it is resident again."""
        model = self.db.get(ModelRow, model_id)
        if model is not None and self._marks(model):
            self.db.touch(ModelRow, model_id, last_request_time=now(), resident=True)
