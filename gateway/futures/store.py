"""Futures: every slow Tinker call becomes a row in the database plus a job run in the
background (gateway/jobs/engine.py); `retrieve_future` long-polls on it. A finished sample is
also queued for its sampling session's retrieve_futures poll (gateway/futures/completions.py),
and a pending one can be cancelled.

Any gateway on the database answers any future, and a killed gateway loses none:
- the row stores the request: its typed job (gateway/jobs/), as JSON arguments plus the serialized
  gRPC message (sparse inputs as the SDK sent them), until the future finishes; the submitted job
  runs as it is, and a re-driven one is decoded from that stored form (Jobs.redrive);
- the gateway running a future holds a lease on its row (claimed_by, lease_until) and renews it
  every lease/3; a gateway claims pending rows whose lease lapsed (at start-up and every few
  seconds) and runs them again. The trainer answers a resent (model_id, seq_id) with its first
  result, so re-running a training request applies nothing twice; a sample is simply sampled
  again (its first result was never delivered);
- a future running elsewhere is waited for until its gateway's message says it finished
  (gateway/futures/peers.py), its row read as a net under the messages.

Training jobs of one model run in seq_id order (gateway/futures/order.py); samples run concurrently.
Waiting for a future (the long-poll) is gateway/futures/waits.py. The rows' SQL is FutureStore's.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import datetime
import logging
import os
import socket
import uuid
from typing import Callable

from sqlalchemy import bindparam, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from gateway.errors import OverLimit, error_json
from gateway.futures import completions
from gateway.futures.completions import Completions
from gateway.futures.peers import AGAIN, Peers, Target
from gateway.futures.record import FutureRecord
from gateway.futures.waits import Waits
from gateway import usage
from gateway.jobs.base import Job as TypedJob
from gateway.storage.db import CompletionRow, Database, FutureRow, Status, encodable, now
from gateway.storage.prepared import Prepared
from gateway.traces.spans import Traces
from tinkerd.errors import UserError

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


# Futures are the hot path: statements prepared once (gateway/storage/prepared.py), no ORM unit of work.
_INSERT_FUTURE = Prepared(FutureRow.__table__.insert())
_FUTURES = FutureRow.__table__.c
# Only a pending future finishes: the first of two runs (a re-drive racing a slow owner, a
# cancel) wins, the other's result is dropped.
_FINISH_FUTURE = Prepared(FutureRow.__table__.update().where(
    _FUTURES.request_id == bindparam("rid"), _FUTURES.status == Status.PENDING).values(
    status=bindparam("status"), content_type=bindparam("content_type"), result=bindparam("result"),
    completed_at=bindparam("completed_at"), lease_until=None, request_args=None, request_body=None))
_FUTURE = Prepared(select(*FutureRow.__table__.columns).where(_FUTURES.request_id == bindparam("rid")))
_UNINSERT = Prepared(FutureRow.__table__.delete().where(_FUTURES.request_id == bindparam("rid")))


def _pending_values(row: FutureRecord | FutureRow) -> dict:
    """The row's values as inserted: pending, created now (and the row says it is pending)."""
    values = {c.name: getattr(row, c.name) for c in FutureRow.__table__.columns}
    values.update(status=Status.PENDING, created_at=now(), extra=row.extra or {})
    row.status = Status.PENDING
    return values


class FutureStore:
    """The futures' rows in the database (gateway/storage/db.py FutureRow): inserted with the
    owner's limits, finished once, leased by the gateway running them, claimed once lapsed."""

    def __init__(self, db: Database, peers: Peers | None = None):
        self.db = db
        self.peers = peers              # told of each finish (the other gateways' waiters hear it); None: a tool's

    def insert(self, row: FutureRecord | FutureRow,
               admit: Callable[[Connection], None] | None = None) -> FutureRecord | FutureRow:
        """Inserts a pending future, or returns the existing one with the same idempotency key.
        `admit(conn)`, if given, checks the owner's limits in the inserting transaction (the new
        row counted) and raises to refuse it: nothing is written then. A resend is not admitted
        again."""
        try:
            if admit is None:
                with self.db.engine.begin() as conn:
                    _INSERT_FUTURE.rowcount(conn, _pending_values(row))
            else:
                with self.db.owner_turn(row.owner) as conn:
                    _INSERT_FUTURE.rowcount(conn, _pending_values(row))
                    admit(conn)
            return row
        except IntegrityError:
            with self.db.session() as s:
                return s.scalars(select(FutureRow).where(FutureRow.idempotency_key == row.idempotency_key)).one()

    def insert_many(self, inserts: list[tuple]) -> list:
        """Several `insert`s (each `(row, admit)`), in one transaction on SQLite, whose one writer
        takes them in turn anyway: each admitted with the rows before it counted, a refused one
        taken out again at once. Anything else that fails (a resend's key), and on PostgreSQL
        (whose per-user locks are taken in one order, one user a transaction), each in its own."""
        if len(inserts) > 1 and self.db.one_writer:
            try:
                out: list = []
                with self.db.engine.begin() as conn:
                    for row, admit in inserts:
                        _INSERT_FUTURE.rowcount(conn, _pending_values(row))
                        try:
                            if admit is not None:
                                admit(conn)
                        except (UserError, OverLimit) as refused:    # the limits: this one is not written
                            _UNINSERT.rowcount(conn, {"rid": row.request_id})
                            out.append(refused.with_traceback(None))
                        else:
                            out.append(row)
                return out
            except Exception:  # noqa: BLE001 - then each alone, below
                log.debug("%d inserts together failed; each alone", len(inserts), exc_info=True)
        return _each_alone(self.insert, inserts)

    def finish(self, request_id: str, status: str, content_type: str, result: bytes,
               completion: dict | None = None, also=None, running: int = 0) -> bool:
        """Records the result of a pending future and drops its stored request (nothing re-drives
        a finished future); False if it had finished already (elsewhere). A sample's `completion`
        (a CompletionRow's values) is written in the same transaction: no gateway can finish a
        sample that no retrieve_futures poll will report; and so is `also(connection)` (its usage).
        `running`: the sample's sampling session's samples still running here (the other
        gateways' polls are told)."""
        with self.db.engine.begin() as conn:
            finished = self._finish_in(conn, request_id, status, content_type, result, completion, also, running)
        if finished:
            self._committed(request_id, completion, running)
        return finished

    def finish_many(self, finishes: list[tuple]) -> list[bool | Exception]:
        """Several `finish`es (each its arguments, as a tuple) in one transaction, whatever each
        answers; if that transaction fails, each again in its own, so an error is only its own."""
        if len(finishes) > 1:
            try:
                with self.db.engine.begin() as conn:
                    done = [self._finish_in(conn, *f) for f in finishes]
            except Exception:  # noqa: BLE001 - then each alone, below
                log.debug("%d finishes together failed; each alone", len(finishes), exc_info=True)
            else:
                for (request_id, _, _, _, completion, _, running), finished in zip(finishes, done):
                    if finished:
                        self._committed(request_id, completion, running)
                return done
        return _each_alone(self.finish, finishes)

    def _finish_in(self, conn, request_id: str, status: str, content_type: str, result: bytes,
                   completion: dict | None, also, running: int) -> bool:
        stamp = now()
        finished = _FINISH_FUTURE.rowcount(conn, {"rid": request_id, "status": status, "content_type": content_type,
                                                  "result": result, "completed_at": stamp}) > 0
        if not finished:
            return False
        if completion is not None:
            completions.insert(conn, completion, request_id, stamp)
        if also is not None:
            also(conn)
        if self.peers is not None:
            self.peers.in_transaction(conn, request_id, _target(completion), running)
        return True

    def _committed(self, request_id: str, completion: dict | None, running: int) -> None:
        if self.peers is not None:
            self.peers.committed(request_id, _target(completion), running)

    def get(self, request_id: str) -> FutureRecord | None:
        """The future's row (a result not kept in this gateway's memory: another gateway's, an
        older one), without the ORM's object."""
        if not encodable(request_id):
            return None
        with self.db.engine.connect() as conn:
            row = _FUTURE.first(conn, {"rid": request_id})
        return None if row is None else FutureRecord(**row._asdict())

    def status(self, request_id: str) -> str | None:
        with self.db.engine.connect() as conn:
            return conn.execute(select(_FUTURES.status).where(_FUTURES.request_id == request_id)).scalar()

    def type_by_key(self, idempotency_key: str) -> str | None:
        """The request type of the future submitted under this key; None if there is none."""
        with self.db.engine.connect() as conn:
            return conn.execute(select(_FUTURES.request_type).where(_FUTURES.idempotency_key == idempotency_key)).scalar()

    def first_pending_seq(self, model_id: str, lo: int, hi: int) -> int | None:
        """The lowest seq_id between `lo` and `hi` (both excluded) of the model's pending
        requests, on any gateway; None if there is none."""
        with self.db.engine.connect() as conn:
            keys = conn.execute(select(_FUTURES.idempotency_key).where(
                _FUTURES.model_id == model_id, _FUTURES.status == Status.PENDING)).scalars().all()
        seqs = [int(seq) for seq in (str(k).rpartition("#")[2] for k in keys) if seq.isdigit()]
        return min((seq for seq in seqs if lo < seq < hi), default=None)

    def renew_leases(self, request_ids: list[str], owner: str, until: datetime.datetime) -> None:
        """Extends the lease of the pending futures this gateway runs."""
        with self.db.engine.begin() as conn:
            for i in range(0, len(request_ids), 500):
                conn.execute(update(FutureRow.__table__).where(
                    _FUTURES.request_id.in_(request_ids[i:i + 500]), _FUTURES.claimed_by == owner,
                    _FUTURES.status == Status.PENDING).values(lease_until=until))

    def claim_lapsed(self, owner: str, until: datetime.datetime, limit: int = 1000) -> list[FutureRow]:
        """Takes over pending futures whose lease lapsed (their gateway died), oldest first. Each
        claim is one conditional UPDATE, so of several gateways claiming at once exactly one gets
        each row (SQLite and Postgres alike)."""
        stamp = now()
        with self.db.session() as s:
            candidates = list(s.scalars(select(FutureRow.request_id).where(
                FutureRow.lease_until < stamp, FutureRow.status == Status.PENDING).order_by(
                FutureRow.created_at).limit(limit)))
        claimed = []
        for request_id in candidates:
            with self.db.engine.begin() as conn:
                n = conn.execute(update(FutureRow.__table__).where(
                    _FUTURES.request_id == request_id, _FUTURES.status == Status.PENDING,
                    _FUTURES.lease_until < stamp).values(claimed_by=owner, lease_until=until)).rowcount
            if n:
                claimed.append(request_id)
        if not claimed:
            return []
        with self.db.session() as s:
            return list(s.scalars(select(FutureRow).where(FutureRow.request_id.in_(claimed))))

    def delete_finished(self, before: datetime.datetime) -> int:
        """Drops futures that finished before `before` (their retention ended)."""
        with self.db.engine.begin() as conn:
            conn.execute(CompletionRow.__table__.delete().where(CompletionRow.__table__.c.finished_at < before))
            return conn.execute(FutureRow.__table__.delete().where(_FUTURES.completed_at < before)).rowcount


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
    """The futures' rows, and the ones this gateway runs (`started` until `finish`): what runs
    them is gateway/jobs/engine.py."""

    def __init__(self, db: Database, lease_s: float = 10.0, traces: Traces | None = None):
        self.db = db
        self.lease_s = lease_s
        self.traces = traces or Traces(db)          # each session's request spans (gateway/traces/spans.py)
        # This process, as the owner of the futures it runs (unique across restarts and hosts).
        self.instance = f"{socket.gethostname()[:32]}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.peers = Peers(db.engine, self.instance)       # the other gateways on the database
        self.store = FutureStore(db, self.peers)           # the rows' SQL
        self.started_at = now()
        self._pending: dict[str, _Pending] = {}        # started here, not finished yet
        self._finished = FinishedResults()
        self._pending_by_type: collections.Counter[str] = collections.Counter()
        self._pending_by_owner: collections.Counter[tuple[str, str]] = collections.Counter()
        self._running_by_target: collections.Counter[Target] = collections.Counter()     # samples, unfinished
        self._submitting: collections.Counter[str] = collections.Counter()   # keys being recorded here, unstarted
        self._cancelled: set[str] = set()              # finished by cancel(); their jobs still running
        self.completions = Completions(db, self.peers, running=self._running_by_target.__getitem__)
        self.waits = Waits(self)
        self.stopping = False       # shutting down: a job cut short is left to be re-driven, not failed

    async def elsewhere(self, idempotency_key: str) -> bool:
        """Is this model request another gateway's? Its row exists, and it is not one this gateway
        is recording right now (about to be started here)."""
        if idempotency_key in self._submitting:
            return False
        found = await self.db.run(self.store.type_by_key, idempotency_key) is not None
        return found and idempotency_key not in self._submitting

    def heard(self, request_id: str, target: Target | None, running: int) -> None:
        """Another gateway finished `request_id` (a sample of `target`, of which `running` more run
        there; AGAIN: reported again for a resend): its waiters here wake."""
        self.waits.wake(request_id)
        if target is None:
            return
        if running == AGAIN:        # as a resend here: even a poll here that reported it looks again
            self.completions.arrived(target)
        else:
            self.completions.arrived(target, request_id, more_elsewhere=running > 0)

    def lease(self) -> datetime.datetime:
        return now() + datetime.timedelta(seconds=self.lease_s)

    async def record(self, job: TypedJob, *, owner: str, fingerprint: str | None = None,
                     idempotency_key: str | None = None, model_id: str | None = None, seq_id: int | None = None,
                     target: Target | None = None, request_id: str | None = None,
                     admit=None) -> tuple[FutureRecord | FutureRow, bool]:
        """Records the future, with its request: (its row, whether it is new and is to be started
        here at once). A resend (same idempotency key and the same request) gets the first one
        back; the same key with a different request is a user error. A sample names its `target`,
        the sampling session (and clone) whose retrieve_futures poll reports it. `admit` checks
        the owner's limits with the new future counted (gateway/identity/limits.py) and raises to
        refuse it."""
        request_id, request_type, request = request_id or new_request_id(), job.kind(), job.stored()
        extra = {"seq_id": seq_id} if seq_id is not None else {}
        if target is not None:
            extra["target"] = list(target)
        self._submitting[idempotency_key] += 1
        try:
            # With the other requests arriving meanwhile (an RL step's samples come at once).
            row = await self.db.together(self.store.insert_many, (FutureRecord(
                request_id=request_id, idempotency_key=idempotency_key, fingerprint=fingerprint, owner=owner,
                request_type=request_type, model_id=model_id, extra=extra, request_args=request.args,
                request_body=request.body, claimed_by=self.instance, lease_until=self.lease()), admit))
        finally:      # the caller starts it before anything else runs on the loop: it counts as here from now on
            self._submitting[idempotency_key] -= 1
            if not self._submitting[idempotency_key]:
                del self._submitting[idempotency_key]
        if row.request_id != request_id and (row.fingerprint != fingerprint or row.owner != owner):
            raise UserError(f"{idempotency_key.replace('#', ' seq_id ')} was already used for a different "
                            f"request ({row.request_type}); every request needs its own seq_id")
        if row.request_id != request_id or row.request_id in self._pending:
            if target is not None and row.status != Status.PENDING:    # reported again: the client may have missed it
                await self.db.run(self.completions.report_again, target, row.request_id, row.status == Status.FAILED,
                                  len(row.result or b""))
                self.completions.arrived(target)
            return row, False    # a resend: started (here or on another gateway) or finished
        return row, True

    def started(self, request_id: str, request_type: str, owner: str, model_id: str | None,
                target: Target | None) -> None:
        """The future runs here from now on, until `finish` (and its job's task ends: `ended`)."""
        self._pending[request_id] = _Pending(asyncio.Event(), model_id, request_type, owner, target)
        self._pending_by_type[request_type] += 1
        self._pending_by_owner[owner, request_type] += 1
        if target is not None:
            self._running_by_target[target] += 1
        self.traces.received(request_id, request_type, model_id, target[0] if target else None)
        self.waits.wake(request_id)             # a wait for it elsewhere waits here now (re-driven)

    def ended(self, request_id: str, request_type: str, owner: str) -> None:
        """Its job's task ended (after `finish`, or cancelled with it): its place in this
        gateway's counts (gateway/metrics.py) is freed. The limits count the database instead
        (gateway/identity/limits.py), where a cancelled sample is finished at once."""
        self._cancelled.discard(request_id)
        self._pending_by_type[request_type] -= 1
        self._pending_by_owner[owner, request_type] -= 1

    async def keep_leases(self) -> list[FutureRow]:
        """Renews the lease of every future running here, then claims those whose gateway
        stopped renewing: the rows to run again here, each model's in seq_id order. Called every
        lease/3 (gateway/jobs/engine.py), the first time at start-up."""
        await self.db.run(self.store.renew_leases, list(self._pending), self.instance, self.lease())
        claimed = await self.db.run(self.store.claim_lapsed, self.instance, self.lease())
        return sorted((r for r in claimed if r.request_id not in self._pending),
                      key=lambda r: (r.extra or {}).get("seq_id", 0))

    async def fail_unrunnable(self, row: FutureRow) -> None:
        """A claimed future stored by an older gateway, in a form this one cannot run."""
        await self.db.run(self.store.finish, row.request_id, Status.FAILED, "application/json", error_json(
            f"the gateway running this {row.request_type} request stopped before it finished and the "
            f"request cannot be run again here (it was accepted by an older gateway); send it again", "server"))

    def give_up_leases(self) -> None:
        """A clean shutdown: the futures running here are left unfinished and their leases given
        up at once, so another gateway (or this one restarted) re-drives them without waiting."""
        self.stopping = True
        try:
            self.store.renew_leases(list(self._pending), self.instance, now())
        except Exception:  # noqa: BLE001 - then they are re-driven once the lease lapses
            log.exception("could not give up the leases of %d futures", len(self._pending))

    async def finish(self, request_id: str, status: str, content_type: str, body: bytes, work=None,
                     records=None) -> None:
        """The future's result, written once; dropped if it was finished already (cancelled). In
        the same transaction: `work`, the usage to count (gateway/usage.py Work, or a function of
        the connection making one), and `records(connection)`, the job's other rows."""
        pending = self._pending.pop(request_id, None)
        if pending is None:
            return
        if pending.target is not None:
            self._running_by_target[pending.target] -= 1
            if not self._running_by_target[pending.target]:
                del self._running_by_target[pending.target]
        self.traces.finished(request_id, "cancelled" if request_id in self._cancelled else status)
        completion = None if pending.target is None else Completions.row(pending.target, status == Status.FAILED, len(body))
        added: list[usage.Work] = []

        def also(conn) -> None:
            added.clear()          # a transaction that failed and is run again added nothing
            if records is not None:
                records(conn)
            done = work(conn) if callable(work) else work
            if done is not None and usage.add(conn, done):
                added.append(done)
        # With the other finishes waiting for the database meanwhile (samples finish in bursts).
        if await self.db.together(self.store.finish_many, (
                request_id, status, content_type, body, completion, None if work is None and records is None else also,
                self._running_by_target[pending.target])):
            for done in added:
                usage.counted(done)
            row = FutureRecord(request_id=request_id, status=status, content_type=content_type, result=body,
                               owner=pending.owner, request_type=pending.request_type,
                               extra=None if pending.target is None else {"target": list(pending.target)})
            if pending.target is not None:
                self.completions.arrived(pending.target, request_id)
        else:      # finished elsewhere first (cancelled there, or re-driven by a gateway that thought us dead)
            row = await self.db.run(self.store.get, request_id)
        self._finished.put(row)
        pending.done.set()

    async def cancel(self, request_id: str, owner: str) -> Cancelled | None:
        """cancel_future: the owner's pending sample finishes at once as cancelled (a user
        error for whoever retrieves it); its job's task is then cancelled by the caller, which
        cancels the gRPC call (the sampler aborts the generation in vLLM). A sample running on
        another gateway is finished as cancelled in the database; that gateway's result is then
        dropped. A finished future is left as it is. None if unknown (or another user's)."""
        pending = self._pending.get(request_id)
        if pending is None:
            row = await self.finished_row(request_id)
            if row is None or row.owner != owner:
                return None
            if row.status == Status.PENDING and row.request_type == "sample":    # running on another gateway
                body = _cancelled_body(request_id)
                target = (row.extra or {}).get("target")
                completion = Completions.row(tuple(target), True, len(body)) if target else None
                if await self.db.run(self.store.finish, request_id, Status.FAILED, "application/json", body,
                                     completion):
                    return Cancelled(True, "cancelled")
                row = await self.db.run(self.store.get, request_id)
            elif row.status == Status.PENDING:
                raise UserError(_not_cancellable(request_id, row.request_type))
            return Cancelled(False, "cancelled" if request_id in self._cancelled else row.status)
        if pending.owner != owner:
            return None
        if pending.request_type != "sample":
            raise UserError(_not_cancellable(request_id, pending.request_type))
        self._cancelled.add(request_id)
        await self.finish(request_id, Status.FAILED, "application/json", _cancelled_body(request_id))
        return Cancelled(True, "cancelled")

    def here(self, request_id: str) -> "_Pending | None":
        """The future, if it is scheduled on this gateway and not finished."""
        return self._pending.get(request_id)

    async def finished_row(self, request_id: str) -> FutureRow | None:
        """A finished future's row: from this gateway's recent results, else the database."""
        return self._finished.get(request_id) or await self.db.run(self.store.get, request_id)

    def drop_result(self, request_id: str, owner: str) -> None:
        """The client has this result: it leaves the memory cache (the futures table keeps it)."""
        row = self._finished.get(request_id)
        if row is not None and row.owner == owner:
            self._finished.pop(request_id)

    def pending_of(self, owner: str, request_type: str | None = None) -> int:
        """The owner's futures scheduled here and not finished yet (of one type, or all): this
        gateway's share, for its metrics; the limits count every gateway's (gateway/identity/limits.py)."""
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


def _each_alone(call: Callable, calls: list[tuple]) -> list:
    """`call(*args)` for each of `calls`, each answer its result or its error. An error goes
    without its traceback, whose frames would hold the whole batch; one that is not the limits'
    answer to its caller is logged with it first."""
    out = []
    for args in calls:
        try:
            out.append(call(*args))
        except Exception as e:  # noqa: BLE001 - its caller's
            if not isinstance(e, (UserError, OverLimit)):
                log.warning("%s failed", getattr(call, "__qualname__", call), exc_info=True)
            out.append(e.with_traceback(None))
    return out


def _target(completion: dict | None) -> Target | None:
    return None if completion is None else (completion["sampling_session_id"], completion["clone"])


def _cancelled_body(request_id: str) -> bytes:
    return error_json(f"sample request {request_id} was cancelled (cancel_future) before it finished", "user")


def _not_cancellable(request_id: str, request_type: str) -> str:
    return (f"request {request_id} is a {request_type} request; only samples can be cancelled (a training "
            f"run's requests all run, in seq_id order)")
