"""Completions for retrieve_futures: an SDK with `sample_use_retrieve_futures` (0.28 and later)
long-polls one queue per (sampling session, clone) for its finished samples, in place of one
retrieve_future long-poll per sample, then fetches each payload with retrieve_future.

The queue is the `completions` table (gateway/storage/db.py CompletionRow), so a poll on any
gateway reports a sample finished on any other, and no gateway's restart loses one:
- a row is written in the transaction that finishes its sample (FutureStore.finish);
- a poll answers the target's rows not reported yet, and those reported under a cursor after
  its `prev_cursor` (that answer never reached the client), and gives them a new cursor;
- the next poll's `prev_cursor` acknowledges them (deleted), as do its `retrieved_request_ids`,
  in the transaction of the next look at that target, or within GARBAGE_S by the watcher: a row
  acknowledged is never reported again whether deleted yet or not; a payload fetched with
  retrieve_future deletes its row unless a poll here reported it (an SDK told not to poll, or
  older than 0.28, fetches without polling), with the next look at its target or by the watcher,
  not in a transaction of its own (on PostgreSQL the watcher deletes each such row alone: holding
  no row's lock while it waits for another's, it cannot deadlock with a look);
- a poll needs no look at a target when no completion of it has arrived here since a look here
  reported all there was up to a cursor at or before the poll's `prev_cursor` (`_empty`): an
  acknowledgement-only poll then answers from memory, and a long poll waits for an arrival
  before it looks (SDK 0.38 polls three times for a lone sample; two are acknowledgements);
- rows live at most as long as their futures (housekeeping).
A row another gateway writes wakes a poll waiting here at once, by that gateway's message
(gateway/futures/peers.py); and within WATCH_S by one watcher per gateway that reads the rows new
since it last looked while some poll waits (only every NET_S while messages are heard: the net
under them), and every _IDLE_LOOK_S while none waits but a target is known empty here.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
from typing import Callable

from sqlalchemy import and_, bindparam, delete, func, or_, select, update

from gateway.futures.peers import AGAIN, NET_S, Peers, Target
from gateway.storage.db import CompletionRow, Database, now
from gateway.storage.prepared import Prepared

log = logging.getLogger(__name__)

WATCH_S = 0.05                  # how often the watcher looks for other gateways' completions
# The watcher re-reads this far back: a row's seq is drawn before its transaction commits, so
# (on Postgres) a row may become visible after rows with larger seqs.
_COMMIT_LAG_S = 1.0
_IDLE_LOOK_S = 0.5              # how often the watcher notes the highest seq while no poll waits
GARBAGE_S = 0.5                 # acknowledged rows no look took along are deleted this often
# A poll acknowledging more retrieved ids than this applies them in a look of its own: what waits
# for the watcher stays a few ids a poll, not up to MAX_RETRIEVED_IDS each.
DEFER_IDS = 512

_T = CompletionRow.__table__
_C = _T.c


@dataclasses.dataclass(slots=True)
class Completion:
    request_id: str
    failed: bool
    size: int                   # the payload's bytes (the SDK reserves its memory before fetching)


def insert(conn, completion: dict, request_id: str, at) -> None:
    """A finished sample's completion (Completions.row), not reported yet, written in the caller's
    transaction (which announces it to the other gateways: gateway/futures/peers.py)."""
    _INSERT.rowcount(conn, {**completion, "request_id": request_id, "reported_cursor": None, "finished_at": at})


# Prebuilt statements, parameters apart: the poll path runs them for every sample.
_TARGET = and_(_C.sampling_session_id == bindparam("sid"), _C.clone == bindparam("clone"))
_ACKNOWLEDGE = Prepared(delete(_T).where(_TARGET, _C.reported_cursor <= bindparam("prev")))
_TO_REPORT = Prepared(select(_C.seq, _C.request_id, _C.failed, _C.size).where(
    _TARGET, or_(_C.reported_cursor.is_(None), _C.reported_cursor > bindparam("prev"))).order_by(_C.seq).limit(
    bindparam("limit")))
_REPORTED = Prepared(update(_T).where(_C.seq == bindparam("row")).values(reported_cursor=bindparam("cursor")))
_FETCHED_OF = Prepared(delete(_T).where(_TARGET, _C.request_id == bindparam("rid")))
_NEW = Prepared(select(_C.seq, _C.request_id, _C.sampling_session_id, _C.clone, _C.reported_cursor).where(
    _C.seq > bindparam("low")))
_INSERT = Prepared(_T.insert(), ["sampling_session_id", "clone", "request_id", "failed", "size", "reported_cursor",
                                 "finished_at"])
_ACKED_KEPT = 4096        # targets whose last acknowledgement this process remembers
_UNPOLLED_KEPT = 1 << 16  # fetched payloads' rows waiting to be deleted, at most


class Completions:
    def __init__(self, db: Database, peers: Peers, running: Callable[[Target], int], watch_s: float = WATCH_S):
        """`running(target)`: the target's samples running on this gateway now (a poll woken by one
        of them gathers only while more of them are coming)."""
        self.db = db
        self.peers = peers              # the other gateways on the database: their messages, ours
        self.watch_s = watch_s
        self.running = running
        self._waiting: dict[Target, list[asyncio.Event]] = {}     # polls waiting here, by target
        # Waited-for targets with a completion since a poll last woke whose writer may have more
        # coming: another gateway with more of them running, or one unknown (the watcher's find,
        # a resend's report).
        self._from_elsewhere: set[Target] = set()
        self._seen: collections.deque[tuple[float, int]] = collections.deque()   # (when, highest seq then)
        # Each target's prev_cursor acknowledged last: acknowledging it again deletes nothing (a
        # row reported since has a larger cursor), so the next polls skip the statement.
        self._acked: collections.OrderedDict[Target, int] = collections.OrderedDict()
        self._fetched: collections.OrderedDict[str, None] = collections.OrderedDict()   # rows deleted here
        # Payloads fetched whose rows no poll here reported, by target: they go with the next look
        # at their target or the watcher's garbage.
        self._unpolled: dict[Target, list[str]] = {}
        # Samples a poll here reported: the client's next poll acknowledges each (its prev_cursor,
        # its retrieved_request_ids), so fetching the payload need not delete the row as well.
        self._reported: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._memo = threading.Lock()     # the memos above, used on the database's threads
        # Acknowledgements not applied yet, by target: (the largest prev_cursor, retrieved ids).
        self._garbage: dict[Target, tuple[int, list[str]]] = {}
        self._garbage_at = time.monotonic()
        # Targets whose last look here left nothing to report after this cursor, with no arrival
        # since; and the arrivals during each look in flight, by target (None: by whom unknown).
        self._clean: collections.OrderedDict[Target, int] = collections.OrderedDict()
        self._looking: dict[Target, list[set[str | None]]] = {}

    @staticmethod
    def row(target: Target, failed: bool, size: int) -> dict:
        """A sample's completion as FutureStore.finish writes it."""
        return {"sampling_session_id": target[0], "clone": target[1], "failed": failed, "size": size}

    def arrived(self, target: Target, request_id: str | None = None, more_elsewhere: bool = False) -> None:
        """A completion of `target` was written (here, or by another gateway: its message, which
        says whether more of the target's samples run there; the watcher, which knows no
        `request_id`): wake the polls waiting for it at once; the next poll looks. A sample that
        a look here reported already (it committed just before the look read) is no news."""
        if request_id is not None:
            with self._memo:
                if request_id in self._reported:
                    return
        self._clean.pop(target, None)
        for arrivals in self._looking.get(target, ()):
            arrivals.add(request_id)
        if (request_id is None or more_elsewhere) and target in self._waiting:
            self._from_elsewhere.add(target)
        for event in self._waiting.get(target, ()):
            event.set()

    def _empty(self, target: Target, prev_cursor: int) -> bool:
        """Whether a look at `target` now would report nothing (see the module's docstring)."""
        clean = self._clean.get(target)
        return clean is not None and prev_cursor >= clean

    def _defer(self, target: Target, prev_cursor: int, retrieved: list[str]) -> None:
        """A poll's acknowledgements, for the next look at its target or the watcher."""
        with self._memo:
            if not retrieved and self._acknowledged(target, prev_cursor):
                return
            cursor, ids = self._garbage.get(target, (0, []))
            self._garbage[target] = (max(cursor, prev_cursor), ids + list(retrieved))

    def _garbage_of(self, target: Target) -> list[str]:
        """The retrieved ids waiting to go of `target` (the look applies its cursor itself)."""
        with self._memo:
            return self._garbage.pop(target, (0, []))[1]

    def collect_garbage(self) -> None:
        """Every acknowledgement and fetched payload's row not applied yet, in one transaction
        (the database's thread)."""
        with self._memo:
            garbage, self._garbage = self._garbage, {}
            fetched, self._unpolled = self._unpolled, {}
        try:
            self._delete_fetched(fetched)
        except BaseException:
            for target, request_ids in fetched.items():
                self._unfetched(target, request_ids)
            raise
        if not garbage:
            return
        with self.db.engine.begin() as conn:
            for target, (prev_cursor, retrieved) in garbage.items():
                if retrieved:
                    self._discard_all(conn, retrieved, target)
                self._acknowledge(conn, target, prev_cursor)

    def _delete_fetched(self, fetched: dict[Target, list[str]]) -> None:
        """The rows of payloads fetched here: in one transaction on SQLite (one writer at a time:
        no deadlock), each in its own on PostgreSQL; those deleted leave `fetched`."""
        rows = [{"sid": t[0], "clone": t[1], "rid": r} for t, ids in fetched.items() for r in ids]
        if not rows:
            return
        if self.db.one_writer:
            with self.db.engine.begin() as conn:
                _FETCHED_OF.executemany(conn, rows)
            fetched.clear()
            return
        for target, request_ids in list(fetched.items()):
            while request_ids:
                with self.db.engine.begin() as conn:
                    _FETCHED_OF.rowcount(conn, {"sid": target[0], "clone": target[1], "rid": request_ids[0]})
                request_ids.pop(0)
            del fetched[target]

    def _acknowledged(self, target: Target, prev_cursor: int) -> bool:
        """Whether acknowledging `prev_cursor` would delete nothing (under self._memo)."""
        return not prev_cursor or self._acked.get(target) == prev_cursor

    def _acknowledge(self, conn, target: Target, prev_cursor: int) -> None:
        """The target's rows reported at or before `prev_cursor` go (once per cursor)."""
        with self._memo:
            if self._acknowledged(target, prev_cursor):
                return
        _ACKNOWLEDGE.rowcount(conn, {"sid": target[0], "clone": target[1], "prev": prev_cursor})
        with self._memo:
            self._acked.pop(target, None)
            self._acked[target] = prev_cursor
            while len(self._acked) > _ACKED_KEPT:
                self._acked.popitem(last=False)

    def report_again(self, target: Target, request_id: str, failed: bool, size: int) -> None:
        """A resent sample that had finished: the client may have missed its report (the caller
        wakes the target's polls: `arrived`)."""
        with self.db.engine.begin() as conn:
            _FETCHED_OF.rowcount(conn, {"sid": target[0], "clone": target[1], "rid": request_id})
            insert(conn, self.row(target, failed, size), request_id, now())
            self.peers.in_transaction(conn, request_id, target, AGAIN)
        self.peers.committed(request_id, target, AGAIN)

    def fetched(self, request_id: str, target: Target) -> None:
        """The client has the payload (fetched with retrieve_future): its row goes, unless a poll
        here reported it (then the client's next poll acknowledges it: one delete, not two). It
        goes with the next look at `target` (so no poll after the fetch reports it) or with the
        watcher's garbage, about GARBAGE_S later: no hand-off to the database's threads of its own."""
        with self._memo:
            if request_id in self._reported:
                return
            self._unpolled.setdefault(target, []).append(request_id)
            self._fetched[request_id] = None
            while len(self._fetched) > _ACKED_KEPT:
                self._fetched.popitem(last=False)

    def _unfetched(self, target: Target, request_ids: list[str]) -> None:
        """Rows whose delete failed, for the next one; past _UNPOLLED_KEPT of a target (a
        database down for long) its oldest are left to housekeeping, which deletes them with
        their futures."""
        if not request_ids:
            return
        with self._memo:
            waiting = self._unpolled.setdefault(target, [])
            waiting[:0] = request_ids
            del waiting[:-_UNPOLLED_KEPT]

    def _discard_all(self, conn, request_ids: list[str], target: Target) -> None:
        """The target's rows of these samples go (retrieve_futures' `retrieved_request_ids`), but
        for those this process deleted already when their payloads were fetched here."""
        with self._memo:
            left = [r for r in request_ids if r not in self._fetched]
            for r in request_ids:
                self._reported.pop(r, None)
        _FETCHED_OF.executemany(conn, [{"sid": target[0], "clone": target[1], "rid": r} for r in left])

    def _take(self, target: Target, prev_cursor: int, limit: int, retrieved: list[str] = (),
              fetched: list[str] = ()) -> tuple[list[Completion], int]:
        """One transaction: the target's rows of payloads `fetched` here and `retrieved` go,
        what `prev_cursor` covers is acknowledged, then (at most `limit`) the rows not reported
        yet or reported after it are reported, under a new cursor."""
        where = {"sid": target[0], "clone": target[1], "prev": prev_cursor}
        with self.db.engine.begin() as conn:
            if fetched:
                _FETCHED_OF.executemany(conn, [{"sid": target[0], "clone": target[1], "rid": r} for r in fetched])
            if retrieved:
                self._discard_all(conn, retrieved, target)
            self._acknowledge(conn, target, prev_cursor)
            rows = _TO_REPORT.all(conn, {**where, "limit": limit})
            if not rows:
                return [], prev_cursor
            # Above prev_cursor, so the next poll acknowledges these rows and no others.
            cursor = max(prev_cursor + 1, rows[-1].seq)
            _REPORTED.executemany(conn, [{"row": r.seq, "cursor": cursor} for r in rows])
        with self._memo:
            for r in rows:
                self._reported[r.request_id] = None
            while len(self._reported) > _ACKED_KEPT:
                self._reported.popitem(last=False)
        return [Completion(r.request_id, r.failed, r.size) for r in rows], cursor

    async def poll(self, target: Target, prev_cursor: int, timeout_s: float, limit: int,
                   gather_s: float = 0.0, retrieved: list[str] = ()) -> tuple[list[Completion], int]:
        """The target's completions after `prev_cursor` (which acknowledges those before, as
        `retrieved` does the payloads the client has), at most `limit`, waiting up to `timeout_s`
        for one, then `gather_s` more for others that finish just after it (samples of one burst
        finish close together: one answer, not one each), unless it finished here and no other of
        the target's samples runs here (a lone sample's answer waits for nothing); and the cursor
        to send back next: `prev_cursor` itself when none (a larger one would make the SDK send an
        acknowledgement for nothing)."""
        self._defer(target, prev_cursor, retrieved)
        if timeout_s <= 0:
            if self._empty(target, prev_cursor) and len(retrieved) <= DEFER_IDS:
                return [], prev_cursor
            return await self._look(target, prev_cursor, limit)
        event = asyncio.Event()
        waiters = self._waiting.setdefault(target, [])
        waiters.append(event)
        try:
            if not self._seen:      # before the first look: no row slips by
                stamp, highest = time.monotonic(), await self.db.run(self._highest)
                if not self._seen:
                    self._seen.append((stamp, highest))
            deadline = time.monotonic() + timeout_s
            wait_first = self._empty(target, prev_cursor)
            while True:
                event.clear()           # before the look: a sample finished while it runs sets it again
                if wait_first:
                    wait_first, found, cursor = False, [], prev_cursor
                else:
                    found, cursor = await self._look(target, prev_cursor, limit)
                left = deadline - time.monotonic()
                if found or left <= 0:
                    return found, cursor
                try:
                    await asyncio.wait_for(event.wait(), left)
                except asyncio.TimeoutError:
                    continue
                elsewhere = target in self._from_elsewhere
                self._from_elsewhere.discard(target)
                if gather_s > 0 and (elsewhere or self.running(target)):
                    await asyncio.sleep(gather_s)
        finally:
            waiters.remove(event)
            if not waiters:
                del self._waiting[target]
                self._from_elsewhere.discard(target)

    async def _look(self, target: Target, prev_cursor: int, limit: int) -> tuple[list[Completion], int]:
        """One look at the target (with its acknowledgements waiting). When it found fewer than
        `limit` rows and nothing arrived meanwhile but what it found, nothing is left to report
        after the cursor it answers: the target is marked empty there (a client that never got
        this answer polls again from an older cursor, and that poll looks)."""
        arrivals: set[str | None] = set()
        self._looking.setdefault(target, []).append(arrivals)
        retrieved = self._garbage_of(target)
        with self._memo:
            fetched = self._unpolled.pop(target, [])
        try:
            found, cursor = await self.db.run(self._take, target, prev_cursor, limit, retrieved, fetched)
        except BaseException:
            self._defer(target, 0, retrieved)         # for the next look, or the watcher
            self._unfetched(target, fetched)
            raise
        finally:
            looks = [a for a in self._looking[target] if a is not arrivals]      # this look's, not an equal one
            if looks:
                self._looking[target] = looks
            else:
                del self._looking[target]
        self._clean.pop(target, None)
        if len(found) < limit and arrivals <= {c.request_id for c in found}:
            self._clean[target] = cursor
            while len(self._clean) > _ACKED_KEPT:
                self._clean.popitem(last=False)
        return found, cursor

    def _highest(self) -> int:
        with self.db.engine.connect() as conn:
            return conn.execute(select(func.coalesce(func.max(_C.seq), 0))).scalar()

    async def look(self) -> None:
        """Wakes the polls waiting here for rows written since the watcher last looked (less
        _COMMIT_LAG_S), by any gateway. While none waits it still notes the highest seq now and
        then (_IDLE_LOOK_S): a poll that comes then starts from a seq of before the lag, not from one
        drawn after rows that commit later (those would be missed until the poll's next look)."""
        stamp = time.monotonic()
        while len(self._seen) > 1 and self._seen[1][0] < stamp - _COMMIT_LAG_S:
            self._seen.popleft()
        if stamp - self._garbage_at >= GARBAGE_S:
            self._garbage_at = stamp
            with self._memo:
                collect = bool(self._garbage or self._unpolled)
            if collect:
                await self.db.run(self.collect_garbage)
        if not self._waiting:
            if not self._seen or stamp - self._seen[-1][0] >= _IDLE_LOOK_S:
                if self._clean and self._seen:      # a target known empty must hear of new rows
                    await self._arrivals_since(stamp)
                else:
                    highest = await self.db.run(self._highest)
                    self._seen.append((stamp, max(highest, self._seen[-1][1] if self._seen else 0)))
            return
        if not self._seen:        # the first poll is still reading its start
            return
        await self._arrivals_since(stamp)

    async def _arrivals_since(self, stamp: float) -> None:
        """The rows new since the watcher's look of _COMMIT_LAG_S ago: those not reported arrive
        (nor by a poll here since the read: its look saw them, and a target it marked empty
        stays so)."""
        low = self._seen[0][1]
        rows = await self.db.run(self._new_since, low)
        self._seen.append((stamp, max([low] + [r.seq for r in rows])))
        with self._memo:
            new = {(r.sampling_session_id, r.clone) for r in rows
                   if r.reported_cursor is None and r.request_id not in self._reported}
        for target in new:
            self.arrived(target)

    def _new_since(self, low: int) -> list:
        with self.db.engine.connect() as conn:
            return _NEW.all(conn, {"low": low})

    async def watch_forever(self) -> None:
        while True:
            try:
                await self.look()
            except Exception:  # noqa: BLE001 - a database hiccup: the polls still end at their timeout
                log.exception("could not look for completions")
            # While the other gateways' messages are heard the watcher is only the net under them.
            await asyncio.sleep(max(self.watch_s, NET_S) if self.peers.listening else self.watch_s)

    def queued(self) -> int:
        """Rows not acknowledged yet (those acknowledged go first)."""
        self.collect_garbage()
        with self.db.engine.connect() as conn:
            return conn.execute(select(func.count()).select_from(_T)).scalar()

