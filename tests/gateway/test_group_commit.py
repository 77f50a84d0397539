"""Group commit: the futures' inserts and finishes that wait for the database's thread meanwhile
go in one transaction (Database.together, FutureStore.insert_many / finish_many), and each still
gets its own answer: a refused insert is not written and the others are; a resend's key, or a
finish whose writes fail, fails alone; the sample caps count every row before them. On
PostgreSQL nothing is gathered: its threads write side by side."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref

import pytest
from sqlalchemy import event, func, select

from gateway.errors import OverLimit
from gateway.futures.store import FutureStore
from gateway.storage.db import Database, FutureRow, Status


def _sample(request_id: str, owner: str = "alice") -> FutureRow:
    return FutureRow(request_id=request_id, idempotency_key=f"samp-{request_id}#0", owner=owner,
                     request_type="sample")


def _at_most(n: int):
    """An admission as the limits' (gateway/identity/limits.py): the owner's pending samples,
    the new row counted, at most `n`."""
    def admit(conn) -> None:
        pending = conn.execute(select(func.count()).select_from(FutureRow).where(
            FutureRow.owner == "alice", FutureRow.status == Status.PENDING)).scalar()
        if pending > n:
            raise OverLimit(f"{pending - 1} of your samples are in flight (limit {n})")
    return admit


def _rows(db: Database) -> list[str]:
    with db.session() as s:
        return sorted(s.scalars(select(FutureRow.request_id)))


def test_calls_waiting_meanwhile_are_taken_at_once_and_each_gets_its_answer(tmp_path):
    db = Database(f"sqlite:///{tmp_path}/t.db")      # SQLite: one database thread
    calls: list[list[int]] = []

    def doubled(items: list[int]) -> list:
        calls.append(list(items))
        return [ValueError(f"{i} is odd") if i % 2 else 2 * i for i in items]

    async def main():
        release = threading.Event()
        busy = asyncio.ensure_future(db.run(release.wait, 10))        # holds the one thread
        await asyncio.sleep(0.05)
        waiting = [asyncio.ensure_future(db.together(doubled, i)) for i in range(6)]
        await asyncio.sleep(0.05)
        release.set()
        answers = await asyncio.gather(*waiting, return_exceptions=True)
        assert await busy is True
        assert await db.together(doubled, 10) == 20                    # alone: a call of its own
        return answers
    answers = asyncio.run(main())
    assert calls == [[0, 1, 2, 3, 4, 5], [10]]
    assert [a if isinstance(a, int) else str(a) for a in answers] == [0, "1 is odd", 4, "3 is odd", 8, "5 is odd"]


def test_inserts_together_admit_each_with_the_rows_before_it_and_write_no_refused_one(tmp_path):
    db = Database(f"sqlite:///{tmp_path}/t.db")
    store = FutureStore(db)
    commits = []
    event.listen(db.engine, "commit", lambda conn: commits.append(1))
    out = store.insert_many([(_sample(f"r{i}"), _at_most(3)) for i in range(5)] + [(_sample("b0", "bob"), None)])
    assert len(commits) == 1
    assert [r.request_id if isinstance(r, FutureRow) else type(r).__name__ for r in out] == \
        ["r0", "r1", "r2", "OverLimit", "OverLimit", "b0"]
    assert "limit 3" in str(out[3])
    assert _rows(db) == ["b0", "r0", "r1", "r2"]
    # The same admission one at a time agrees: the cap is full.
    with pytest.raises(OverLimit):
        store.insert(_sample("r9"), _at_most(3))


def test_a_resend_among_inserts_together_gets_the_first_row_and_the_others_are_written(tmp_path):
    db = Database(f"sqlite:///{tmp_path}/t.db")
    store = FutureStore(db)
    store.insert(_sample("first"))
    resend = FutureRow(request_id="second-try", idempotency_key="samp-first#0", owner="alice", request_type="sample")
    out = store.insert_many([(_sample("a"), None), (resend, None), (_sample("b"), None)])
    assert [r.request_id for r in out] == ["a", "first", "b"]
    assert _rows(db) == ["a", "b", "first"]


def test_finishes_together_commit_once_and_a_failing_one_fails_alone(tmp_path):
    db = Database(f"sqlite:///{tmp_path}/t.db")
    store = FutureStore(db)
    for rid in ("a", "b", "c", "d", "e"):
        store.insert(_sample(rid))
    commits = []
    event.listen(db.engine, "commit", lambda conn: commits.append(1))
    assert store.finish_many([(rid, Status.COMPLETE, "application/json", b"0", None, None, 0)
                              for rid in ("d", "e")]) == [True, True]
    assert len(commits) == 1 and store.status("e") == Status.COMPLETE
    store.finish("c", Status.COMPLETE, "application/json", b"{}")         # finished already

    def broken(conn) -> None:
        raise RuntimeError("usage could not be written")
    out = store.finish_many([("a", Status.COMPLETE, "application/json", b"1", None, None, 0),
                             ("b", Status.COMPLETE, "application/json", b"2", None, broken, 0),
                             ("c", Status.COMPLETE, "application/json", b"3", None, None, 0)])
    assert out[0] is True and isinstance(out[1], RuntimeError) and out[2] is False
    assert store.status("a") == Status.COMPLETE and store.status("b") == Status.PENDING
    assert store.get("c").result == b"{}"


def test_on_a_database_server_each_call_is_its_own_and_they_run_side_by_side(tmp_path):
    """PostgreSQL: the database's threads write side by side; gathering would make all but one wait."""
    pytest.importorskip("pgserver")
    from harness.postgres import postgres

    arrived = threading.Barrier(3, timeout=10)      # broken unless three calls run at once
    calls: list[list[int]] = []

    def each(items: list[int]) -> list:
        arrived.wait()
        calls.append(list(items))
        return [i + 1 for i in items]

    with postgres(tmp_path / "pg", "tinkerd") as url:
        db = Database(url)

        async def main():
            return await asyncio.gather(*(db.together(each, i) for i in range(3)))
        assert sorted(asyncio.run(main())) == [1, 2, 3]
    assert sorted(calls) == [[0], [1], [2]]


def test_a_refused_insert_leaves_no_row_of_its_batch_alive_for_the_collector(tmp_path):
    """An answer's error holds no frame of the batch (the gateway freezes its heap: full
    collections are rare), so a 429's batch is freed as soon as its callers let it go."""
    db = Database(f"sqlite:///{tmp_path}/t.db")
    store = FutureStore(db)
    rows = [_sample(f"r{i}") for i in range(3)]
    alive = [weakref.ref(r) for r in rows]

    def refuse_the_second(conn) -> None:
        if conn.execute(select(func.count()).select_from(FutureRow)).scalar() == 2:
            raise OverLimit("the second is over the limit")
    gc.disable()
    try:
        out = store.insert_many([(r, refuse_the_second) for r in rows])
        assert isinstance(out[1], OverLimit) and out[1].__traceback__ is None
        del rows, out
        assert [r() for r in alive] == [None, None, None]
    finally:
        gc.enable()


def test_a_caller_cancelled_before_its_batch_is_taken_is_left_out_of_it(tmp_path):
    db = Database(f"sqlite:///{tmp_path}/t.db")
    taken: list[list[int]] = []

    def each(items: list[int]) -> list:
        taken.append(list(items))
        return items

    async def main():
        release = threading.Event()
        busy = asyncio.ensure_future(db.run(release.wait, 10))        # holds the one thread
        await asyncio.sleep(0.05)
        kept, cancelled = asyncio.ensure_future(db.together(each, 1)), asyncio.ensure_future(db.together(each, 2))
        await asyncio.sleep(0.05)
        cancelled.cancel()
        await asyncio.sleep(0)
        release.set()
        assert await kept == 1 and await busy is True
    asyncio.run(main())
    assert taken == [[1]]
