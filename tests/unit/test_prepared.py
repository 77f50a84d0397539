"""The hot statements run on the DBAPI cursor (gateway/storage/prepared.py) write and read what
SQLAlchemy's own execution of the same statements does, on SQLite and on PostgreSQL: every type
the futures, completions, usage and step-metric rows hold, a statement's fixed values, a
RETURNING that returns nothing, a rowcount, one statement run for several rows; a constraint
broken is SQLAlchemy's IntegrityError; listeners see each statement."""

import datetime

import pytest
from sqlalchemy import event, select
from sqlalchemy.exc import IntegrityError

from gateway import step_metrics, usage
from gateway.futures import completions
from gateway.futures.store import _FINISH_FUTURE, _INSERT_FUTURE
from gateway.identity import limits
from gateway.storage.db import CompletionRow, Database, FutureRow, StepMetricRow, UsageRow, now


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def url(request, tmp_path_factory):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('db') / 'prepared.db'}"
        return
    from harness.postgres import postgres
    with postgres(tmp_path_factory.mktemp("pg"), "tinkerd") as pg:
        yield pg


def _future(request_id: str, key: str) -> dict:
    return dict(request_id=request_id, idempotency_key=key, fingerprint="f" * 64, owner="alice",
                request_type="forward_backward", model_id="m1", status="pending", content_type=None, result=None,
                extra={"seq_id": 3, "target": ["s", 0]}, created_at=now(), completed_at=None,
                request_args={"loss_fn": "cross_entropy", "ids": [1, 2]}, request_body=b"\x00\x01body",
                claimed_by="gw-1", lease_until=now() + datetime.timedelta(seconds=10))


def test_prepared_statements_write_and_read_what_sqlalchemy_does(url):
    db = Database(url)
    seen: list[str] = []
    event.listen(db.engine, "before_cursor_execute", lambda _c, _cur, sql, *_: seen.append(sql.split()[0]))
    with db.engine.begin() as conn:
        _INSERT_FUTURE.rowcount(conn, _future("r1", "m1#3"))
        conn.execute(FutureRow.__table__.insert(), _future("r2", "m1#4"))          # the same, through Core
    assert seen == ["INSERT", "INSERT"]
    with pytest.raises(IntegrityError):
        with db.engine.begin() as conn:
            _INSERT_FUTURE.rowcount(conn, _future("r3", "m1#3"))                   # the key is taken
    with db.engine.connect() as conn:
        one, two = (conn.execute(select(FutureRow.__table__).where(FutureRow.request_id == r)).one()._asdict()
                    for r in ("r1", "r2"))
    assert {k: v for k, v in one.items() if k not in ("request_id", "idempotency_key", "created_at",
                                                         "lease_until")} == \
        {k: v for k, v in two.items() if k not in ("request_id", "idempotency_key", "created_at", "lease_until")}
    assert one["extra"] == {"seq_id": 3, "target": ["s", 0]} and one["request_body"] == b"\x00\x01body"
    assert abs(one["lease_until"] - one["created_at"]) > datetime.timedelta(seconds=9)

    finish = {"rid": "r1", "status": "complete", "content_type": "application/json", "result": b"{}",
              "completed_at": now()}
    with db.engine.begin() as conn:
        assert _FINISH_FUTURE.rowcount(conn, finish) == 1
        assert _FINISH_FUTURE.rowcount(conn, finish) == 0         # only a pending future finishes
        completions.insert(conn, {"sampling_session_id": "s", "clone": 0, "failed": True, "size": 7}, "r1", now())
    for n in range(8):            # past psycopg's prepare_threshold (5): prepared server-side, rowcount still true
        with db.engine.begin() as conn:
            _INSERT_FUTURE.rowcount(conn, _future(f"p{n}", f"m1#{10 + n}"))
            assert _FINISH_FUTURE.rowcount(conn, {**finish, "rid": f"p{n}"}) == 1
            assert _FINISH_FUTURE.rowcount(conn, {**finish, "rid": f"p{n}"}) == 0
    done = db.get(FutureRow, "r1")
    assert (done.status, done.result, done.request_args, done.request_body, done.lease_until) == \
        ("complete", b"{}", None, None, None)
    with db.engine.begin() as conn:
        reported = completions._TO_REPORT.all(conn, {"sid": "s", "clone": 0, "prev": 0, "limit": 10})
        assert reported == [tuple(r) for r in conn.execute(select(
            CompletionRow.seq, CompletionRow.request_id, CompletionRow.failed, CompletionRow.size))]
        assert reported[0].failed is True and reported[0].request_id == "r1"
        completions._REPORTED.executemany(conn, [{"row": reported[0].seq, "cursor": 9}, {"row": -1, "cursor": 9}])
        assert conn.execute(select(CompletionRow.reported_cursor)).scalars().all() == [9]
        completions._FETCHED_OF.executemany(conn, [{"sid": "s", "clone": 1, "rid": "r1"}])     # another target's
        assert conn.execute(select(CompletionRow.request_id)).scalars().all() == ["r1"]
        completions._FETCHED_OF.executemany(conn, [{"sid": "s", "clone": 0, "rid": "r1"}])
        assert conn.execute(select(CompletionRow.request_id)).scalars().all() == []
        assert limits.pending_training_in(conn, "alice") == 1 and limits.pending_samples_in(conn, "alice") == (0, 0)
        assert limits.pending_training_bytes_in(conn, "alice") == len(b"\x00\x01body")

    work = usage.Work("train:m1#3", "alice", "sess", "base", (("training", False, 64),))
    with db.engine.begin() as conn:
        assert usage.add(conn, work) and not usage.add(conn, work)       # RETURNING nothing: counted once
    assert [(r.owner, r.kind, r.quantity) for r in db.select(select(UsageRow))] == [("alice", "training", 64)]

    values = {"model_id": "m1", "seq_id": 3, "kind": "forward_backward", "metrics": {"loss:sum": 1.5}, "at": now()}
    with db.engine.begin() as conn:
        step_metrics._INSERTS[db.engine.dialect.name].rowcount(conn, values)
        step_metrics._INSERTS[db.engine.dialect.name].rowcount(conn, {**values, "seq_id": 4, "kind": "optim_step"})
    rows = db.select(select(StepMetricRow).order_by(StepMetricRow.seq_id))
    assert [(r.seq_id, r.step, r.metrics) for r in rows] == [(3, 1, {"loss:sum": 1.5}), (4, 1, {"loss:sum": 1.5})]
