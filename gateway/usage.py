"""Usage for chargeback, counted where the work happens: once the trainer or a sampler answered a
request, its job adds what it did to the hour's bucket of its user, session and base model
(gateway/storage/db.py UsageRow): tokens trained (forward_backward and forward: every datum's
input tokens), prefilled (a sample's prompt, once per request however many samples) and sampled
(every sequence's tokens), and checkpoints made. The reports are gateway/billing.py's.

Exactly once: each piece of work has a key (a model's `<model_id>#<seq_id>`, a sample's request
id), written in the transaction that adds it to the buckets. A request run again -- re-driven by
another gateway after this one died, or answered again by a restarted trainer from its ledger --
finds its key and adds nothing; one whose gateway died before counting is counted by the gateway
that re-drives it. Keys are kept for --futures-retention-s (a finished future never runs again).

Storage: each checkpoint's bytes on disk, measured when it is written, from then until it is
deleted, expires or is overwritten (CheckpointStorageRow); GB-hours are worked out from those
intervals for any window. Housekeeping (`reconcile`) closes the interval of a checkpoint whose
row went by another path and opens one for a checkpoint that has none (made before usage was
kept), so the current storage always matches the checkpoints there are.

Prefill served from vLLM's prefix cache is not told apart here: all prefill is counted uncached.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
import os

from prometheus_client import Counter
from sqlalchemy import and_, bindparam, exists, select, update
from sqlalchemy.dialects import postgresql, sqlite

from gateway.storage.db import (CheckpointRow, CheckpointStorageRow, Database, FutureRow, ModelRow,
                                SamplingSessionRow, SessionRow, UsageCountedRow, UsageRow, aware, now)
from gateway.storage.prepared import Prepared

log = logging.getLogger(__name__)

COUNTED = Counter("tinkerd_gateway_usage_total", "usage counted for chargeback (GET /api/v1/billing/usage/"
                  "events), by kind: tokens trained, prefilled and sampled, checkpoints made", ["kind"])
_USAGE, _COUNTED, _STORAGE = UsageRow.__table__, UsageCountedRow.__table__, CheckpointStorageRow.__table__
_BUCKET_KEY = ["bucket_start", "owner", "session_id", "base_model", "kind", "cached"]


def hour_of(t: datetime.datetime) -> datetime.datetime:
    return aware(t).astimezone(datetime.timezone.utc).replace(minute=0, second=0, microsecond=0)


@dataclasses.dataclass(frozen=True)
class Work:
    """What one request did: (kind, cached, quantity) for its user, session and base model."""
    key: str
    owner: str
    session_id: str
    base_model: str
    quantities: tuple[tuple[str, bool, int], ...]


def _insert(conn, table):
    return (postgresql if conn.dialect.name == "postgresql" else sqlite).insert(table)


def _statements(dialect) -> tuple:
    """Per dialect, built once (a request's work runs them with its values): the key's insert, and
    the bucket's upsert with the session's project as it is now, read in the statement (a session
    moved a moment ago counts in its new project)."""
    key = dialect.insert(_COUNTED).values(key=bindparam("key"), at=bindparam("at")).on_conflict_do_nothing().returning(
        _COUNTED.c.key)      # (a prepared statement's rowcount is -1 on psycopg)
    project = select(SessionRow.project_id).where(SessionRow.session_id == bindparam("session_id")).scalar_subquery()
    bucket = dialect.insert(_USAGE).values(
        bucket_start=bindparam("bucket_start"), owner=bindparam("owner"), session_id=bindparam("session_id"),
        base_model=bindparam("base_model"), kind=bindparam("kind"), cached=bindparam("cached"),
        quantity=bindparam("quantity"), project_id=project)
    return key, bucket.on_conflict_do_update(index_elements=_BUCKET_KEY, set_={
        "quantity": _USAGE.c.quantity + bucket.excluded.quantity, "project_id": bucket.excluded.project_id})


_STATEMENTS = {name: tuple(map(Prepared, _statements(dialect))) for name, dialect in (
    ("postgresql", postgresql), ("sqlite", sqlite))}


def count(db: Database, work: Work) -> bool:
    """Adds `work` to its hour's buckets unless its key was counted already (then False)."""
    with db.engine.begin() as conn:
        added = add(conn, work)
    if added:
        counted(work)
    return added


def add(conn, work: Work) -> bool:
    """`count` in the caller's transaction (a sample's is its future's finish); the Prometheus
    counters are the caller's to move, with `counted`, once that transaction commits."""
    at = now()
    key, bucket = _STATEMENTS["postgresql" if conn.dialect.name == "postgresql" else "sqlite"]
    if key.first(conn, {"key": work.key, "at": at}) is None:
        return False
    for kind, cached, quantity in work.quantities:
        if quantity > 0:
            bucket.rowcount(conn, {"bucket_start": hour_of(at), "owner": work.owner, "session_id": work.session_id,
                                  "base_model": work.base_model, "kind": kind, "cached": cached,
                                  "quantity": quantity})
    return True


def counted(work: Work) -> None:
    for kind, _, quantity in work.quantities:
        COUNTED.labels(kind).inc(quantity)


def sample_work(request_id: str, prompt: int, sampled_tokens: int, owner: str, session_id: str,
                base_model: str) -> Work:
    """A sample's tokens: its prompt prefilled once, however many sequences, and every sequence's."""
    return Work(f"sample:{request_id}", owner, session_id, base_model,
                (("sampling_prefill", False, prompt), ("sampling_sample", False, sampled_tokens)))


_RUN = Prepared(select(ModelRow.owner, ModelRow.session_id, ModelRow.base_model).where(
    ModelRow.model_id == bindparam("mid")))


def trained(message):
    """A forward_backward or forward (trainer_pb2.ForwardBackwardRequest) the trainer answered: its
    Work as a function of the connection (its run read there), for the transaction that finishes
    its future (gateway/jobs/base.py Done.usage)."""
    model_id, seq_id, tokens = message.model_id, message.seq_id, sum(len(d.tokens) for d in message.data)

    def work(conn) -> Work | None:
        run = _RUN.first(conn, {"mid": model_id})
        if run is None:
            log.warning("usage: no run %s for its trained tokens", model_id)
            return None
        return Work(f"train:{model_id}#{seq_id}", run.owner or "", run.session_id, run.base_model,
                    (("training", False, tokens),))
    return work


async def sampled(db: Database, served_model: str, message, reply) -> None:
    """A sample (sampler_pb2.SampleRequest) a replica answered with `reply`, stored by a gateway that
    did not record whose it is (SampleOf): looked up from its future's row."""
    sampled_tokens = sum(len(s.tokens) for s in reply.sequences)
    await asyncio.to_thread(_count_sample, db, served_model, message.request_id,
                            len(message.prompt_tokens), sampled_tokens)


def _count_sample(db: Database, served_model: str, request_id: str, prompt: int, sampled_tokens: int) -> None:
    """Whose: the future's owner; which session and base model: its sampling session's (the
    future's key is `<sampling_session_id>#<seq_id>`; OpenAI requests have none)."""
    with db.session() as s:          # two columns, not the row (it holds the stored request)
        future = s.execute(select(FutureRow.owner, FutureRow.idempotency_key).where(
            FutureRow.request_id == request_id)).first()
    if future is None:
        log.warning("usage: no future %s for its sampled tokens", request_id)
        return
    sampling_id = (future.idempotency_key or "").rpartition("#")[0]
    sampling = db.get(SamplingSessionRow, sampling_id) if sampling_id else None
    session_id, base_model = (sampling.session_id, sampling.base_model) if sampling else ("", served_model)
    count(db, sample_work(request_id, prompt, sampled_tokens, future.owner or "", session_id, base_model))


def disk_bytes(directory: str) -> int | None:
    """The bytes of the files under `directory`; None if it is not there (another host's disk)."""
    if not directory or not os.path.isdir(directory):
        return None
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(directory) for name in names)


async def checkpoint_made(db: Database, tinker_path: str, key: str) -> None:
    """A named checkpoint was written (save_state, save_weights_for_sampler with a name,
    save_weights_external, copy_weights): one checkpoint counted, its storage from now on."""
    await asyncio.to_thread(_checkpoint_made, db, tinker_path, key)


def _checkpoint_made(db: Database, tinker_path: str, key: str) -> None:
    with db.session() as s:          # fresh: the row was just written, maybe replacing another
        row = s.get(CheckpointRow, tinker_path)
    run = db.get(ModelRow, row.model_id) if row is not None else None
    if run is None:
        log.warning("usage: checkpoint %s or its run is gone", tinker_path)
        return
    size = disk_bytes(row.directory)
    with db.engine.begin() as conn:
        work = made(conn, row, run, key, size)
    if work is not None:
        counted(work)


def made(conn, row: CheckpointRow, run: ModelRow, key: str, size: int | None) -> Work | None:
    """`checkpoint_made` in the caller's transaction, the one writing `row` (its bytes on disk
    `size`, measured before: None where they are not on this host): its storage interval opened,
    and its count unless `key` was counted; the Work counted, for `counted` once it commits."""
    _store_in(conn, row, run, size)
    work = Work(f"checkpoint:{key}", row.owner or "", run.session_id, run.base_model, (("checkpoint", False, 1),))
    return work if add(conn, work) else None


def _store(db: Database, row: CheckpointRow, run: ModelRow) -> None:
    size = disk_bytes(row.directory)
    with db.engine.begin() as conn:
        _store_in(conn, row, run, size)


def _store_in(conn, row: CheckpointRow, run: ModelRow, size: int | None) -> None:
    """Opens the checkpoint's storage interval (closing the one it overwrote)."""
    since = aware(row.created_at)
    conn.execute(update(_STORAGE).where(_STORAGE.c.tinker_path == row.tinker_path, _STORAGE.c.until.is_(None),
                                        _STORAGE.c.since < since).values(until=since))
    conn.execute(_insert(conn, _STORAGE).values(
        tinker_path=row.tinker_path, since=since, until=None, size_bytes=size if size is not None else
        row.size_bytes or 0, owner=row.owner or "", session_id=run.session_id,
        base_model=run.base_model).on_conflict_do_nothing())


def checkpoint_gone(db: Database, tinker_path: str) -> None:
    """A checkpoint was deleted or expired: its storage ends now."""
    with db.engine.begin() as conn:
        conn.execute(update(_STORAGE).where(_STORAGE.c.tinker_path == tinker_path, _STORAGE.c.until.is_(None))
                     .values(until=now()))


def session_moved(db: Database, session_id: str, project_id: str) -> None:
    """Usage belongs to its session's current project."""
    with db.engine.begin() as conn:
        conn.execute(update(_USAGE).where(_USAGE.c.session_id == session_id).values(project_id=project_id))


def reconcile(db: Database, keys_before: datetime.datetime, limit: int = 500) -> None:
    """Housekeeping: drops counted keys older than `keys_before`; ends the storage of checkpoints
    whose row is gone; starts it for checkpoints that have none open (made before usage was kept)."""
    checkpoints = CheckpointRow.__table__.c
    with db.engine.begin() as conn:
        conn.execute(_COUNTED.delete().where(_COUNTED.c.at < keys_before))
        conn.execute(update(_STORAGE).where(_STORAGE.c.until.is_(None), ~exists().where(
            checkpoints.tinker_path == _STORAGE.c.tinker_path)).values(until=now()))
        missing = list(conn.execute(select(checkpoints.tinker_path).where(~exists().where(
            and_(_STORAGE.c.tinker_path == checkpoints.tinker_path, _STORAGE.c.until.is_(None)))).limit(limit))
                       .scalars())
    for path in missing:
        with db.session() as s:
            row = s.get(CheckpointRow, path)
        run = db.get(ModelRow, row.model_id) if row is not None else None
        if run is not None:
            _store(db, row, run)
