"""Durable gateway state in a SQL database (SQLite by default, Postgres by URL): users and their
API keys, sessions, training models, futures (with their results), sampling sessions,
checkpoints, the audit log. Every row a user makes carries `owner` (their user id)."""

from __future__ import annotations

import datetime
import logging
import time

from sqlalchemy import (JSON, BigInteger, Boolean, DateTime, Index, Integer, LargeBinary, String, Text, and_, case,
                        bindparam, create_engine, event, func, or_, select, text, update)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from gateway import schema

log = logging.getLogger(__name__)


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def aware(t: datetime.datetime) -> datetime.datetime:
    """SQLite hands back naive datetimes; we store UTC."""
    return t if t.tzinfo else t.replace(tzinfo=datetime.timezone.utc)


class Base(DeclarativeBase):
    pass


class UserRow(Base):
    __tablename__ = "users"
    user_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    org_id: Mapped[str] = mapped_column(String(128))
    email: Mapped[str] = mapped_column(String(256), default="")
    admin: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True), default=now)


class ApiKeyRow(Base):
    """An API key `tml-<key_id>-<secret>` is stored as its id and the SHA-256 of its secret: the
    secret is 256 random bits, so a fast hash is enough and the database never holds a usable key."""
    __tablename__ = "api_keys"
    key_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    user_id: Mapped[str] = mapped_column(String(64), index=True)
    secret_sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True), default=now)
    revoked_at: Mapped[datetime.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class ServerSecretRow(Base):
    """Secrets the gateway makes once and keeps (the JWT and signed-URL signing key): in the
    database, so every gateway process on it agrees."""
    __tablename__ = "server_secrets"
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(String(128))


class AuditRow(Base):
    __tablename__ = "audit_events"
    event_id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True), default=now, index=True)
    org_id: Mapped[str] = mapped_column(String(128), index=True)
    user_id: Mapped[str] = mapped_column(String(64))
    event: Mapped[str] = mapped_column(String(64))
    details: Mapped[dict] = mapped_column(JSON, default=dict)


class SessionRow(Base):
    __tablename__ = "sessions"
    session_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    owner: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)
    created_at: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True), default=now)
    last_heartbeat: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True), default=now)
    tags: Mapped[list] = mapped_column(JSON, default=list)
    user_metadata: Mapped[dict] = mapped_column(JSON, default=dict)
    finished: Mapped[bool] = mapped_column(Boolean, default=False)


class ModelRow(Base):
    __tablename__ = "models"
    model_id: Mapped[str] = mapped_column(String(256), primary_key=True)
    session_id: Mapped[str] = mapped_column(String(128), index=True)
    owner: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)
    base_model: Mapped[str] = mapped_column(String(512))
    lora_rank: Mapped[int] = mapped_column(Integer)
    lora_config: Mapped[dict] = mapped_column(JSON)
    created_at: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True), default=now)
    last_request_time: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True), default=now)
    # False once unloaded for a lapsed session; the trainer reloads it on next use.
    resident: Mapped[bool] = mapped_column(Boolean, default=True)


class FutureRow(Base):
    __tablename__ = "futures"
    request_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    # (model_id, seq_id) or (sampling_session_id, seq_id): a resent request finds its future.
    idempotency_key: Mapped[str | None] = mapped_column(String(512), unique=True, nullable=True)
    # What the request said (a hash): a resend must say the same, or it is a different request.
    fingerprint: Mapped[str | None] = mapped_column(String(64), nullable=True)
    owner: Mapped[str | None] = mapped_column(String(64), nullable=True)
    request_type: Mapped[str] = mapped_column(String(64))
    model_id: Mapped[str | None] = mapped_column(String(256), nullable=True, index=True)
    status: Mapped[str] = mapped_column(String(16), default="pending")  # pending | complete | failed
    content_type: Mapped[str | None] = mapped_column(String(64), nullable=True)
    result: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    extra: Mapped[dict] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True), default=now)
    completed_at: Mapped[datetime.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True,
                                                                   index=True)
    # What re-drives it on any gateway (its typed job, gateway/jobs/base.py StoredRequest): its arguments and the
    # serialized gRPC message.
    request_args: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    request_body: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    # The gateway running it, until when: the owner renews the lease; once it lapses (the owner
    # died) another gateway claims the future and runs it again. NULL once finished.
    claimed_by: Mapped[str | None] = mapped_column(String(64), nullable=True)
    lease_until: Mapped[datetime.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True,
                                                                  index=True)
    # The per-user limits count pending futures (gateway/limits.py): a partial index holds only
    # pending rows, so it stays as small as the queues however many finished rows are kept.
    __table_args__ = (Index("ix_futures_pending", "request_type", "owner",
                            sqlite_where=text("status = 'pending'"), postgresql_where=text("status = 'pending'")),)


class SamplerReplicaRow(Base):
    """A sampler replica that registered itself (gateway/sampler_pool.py); gone once it stops
    heart-beating or deregisters."""
    __tablename__ = "sampler_replicas"
    address: Mapped[str] = mapped_column(String(256), primary_key=True)
    registered_at: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True), default=now)
    last_seen: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True), default=now, index=True)


class SamplingSessionRow(Base):
    __tablename__ = "sampling_sessions"
    sampling_session_id: Mapped[str] = mapped_column(String(256), primary_key=True)
    session_id: Mapped[str] = mapped_column(String(128), index=True)
    owner: Mapped[str | None] = mapped_column(String(64), nullable=True)
    base_model: Mapped[str] = mapped_column(String(512))
    model_path: Mapped[str | None] = mapped_column(Text, nullable=True)
    snapshot_id: Mapped[str] = mapped_column(String(256), default="")   # "" = the base model
    snapshot_path: Mapped[str] = mapped_column(Text, default="")        # its persisted PEFT copy
    created_at: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True), default=now)
    # Its last asample, written at most once a minute (gateway/sessions.py Sessions.used; NULL:
    # none yet): an ephemeral snapshot unused long enough is pruned (gateway/housekeeping.py).
    last_used: Mapped[datetime.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class CheckpointRow(Base):
    __tablename__ = "checkpoints"
    tinker_path: Mapped[str] = mapped_column(String(768), primary_key=True)
    model_id: Mapped[str] = mapped_column(String(256), index=True)
    owner: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)
    checkpoint_type: Mapped[str] = mapped_column(String(16))   # training | sampler
    name: Mapped[str] = mapped_column(String(256))
    snapshot_id: Mapped[str] = mapped_column(String(256), default="")
    snapshot_path: Mapped[str] = mapped_column(Text, default="")
    directory: Mapped[str] = mapped_column(Text, default="")           # the files on disk
    size_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    public: Mapped[bool] = mapped_column(Boolean, default=False)
    user_metadata: Mapped[dict] = mapped_column(JSON, default=dict)
    expires_at: Mapped[datetime.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    created_at: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True), default=now)

    @property
    def checkpoint_id(self) -> str:          # "weights/<name>", "sampler_weights/<name>"
        return self.tinker_path.split("/", 3)[3]


class StepMetricRow(Base):
    """One training request's metrics (gateway/step_metrics.py): what the console draws as curves
    over steps. A few numbers a row, one row per forward_backward/forward/optim_step of a run."""
    __tablename__ = "step_metrics"
    model_id: Mapped[str] = mapped_column(String(256), primary_key=True)
    seq_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    step: Mapped[int] = mapped_column(Integer)          # the optimizer step the request belongs to, from 1
    kind: Mapped[str] = mapped_column(String(32))       # forward_backward | forward | optim_step
    metrics: Mapped[dict] = mapped_column(JSON, default=dict)
    at: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True), default=now)


class StabilityRecordRow(Base):
    """A sequence sampled for stable_reinforce (gateway/stability.py): in the database, so the
    gateway a training step reaches finds what another gateway sampled."""
    __tablename__ = "stability_records"
    # Record order: the count cap drops the lowest ids (an index range, not a count of the table).
    record_id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True,
                                           autoincrement=True)
    sequence_id: Mapped[str] = mapped_column(String(128), unique=True)      # "<request_id>:<i>"
    session_id: Mapped[str] = mapped_column(String(128))                    # whose: only it may use it
    tokens: Mapped[bytes] = mapped_column(LargeBinary)                      # int64, the sampled tokens
    logprobs: Mapped[bytes] = mapped_column(LargeBinary)                    # float32, the sampler's
    used: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True), default=now, index=True)


class CustomLossRow(Base):
    """A server-side custom loss (gateway/custom_losses.py): its checked graph, stored so that any
    gateway can send it with the session's forward_backward requests."""
    __tablename__ = "custom_losses"
    loss_id: Mapped[str] = mapped_column(String(256), primary_key=True)     # "<session_id>:loss:<seq>"
    session_id: Mapped[str] = mapped_column(String(128), index=True)       # only its models may use it
    owner: Mapped[str | None] = mapped_column(String(64), nullable=True)
    name: Mapped[str] = mapped_column(String(128))
    spec_json: Mapped[str] = mapped_column(Text)                            # tinkerd/custom_loss.py LossSpec
    digest: Mapped[str] = mapped_column(String(64))                         # its SHA-256
    created_at: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True), default=now)


@event.listens_for(ModelRow, "after_delete")
def _delete_step_metrics(_mapper, connection, row: ModelRow) -> None:
    """A run's metrics go with it (no foreign key: SQLite would enforce it only with a pragma)."""
    connection.execute(StepMetricRow.__table__.delete().where(StepMetricRow.__table__.c.model_id == row.model_id))


_INSERT_FUTURE = FutureRow.__table__.insert()
_FUTURES = FutureRow.__table__.c
# Only a pending future finishes: the first of two runs (a re-drive racing a slow owner, a
# cancel) wins, the other's result is dropped.
_FINISH_FUTURE = FutureRow.__table__.update().where(
    _FUTURES.request_id == bindparam("rid"), _FUTURES.status == "pending").values(
    status=bindparam("status"), content_type=bindparam("content_type"), result=bindparam("result"),
    completed_at=bindparam("completed_at"), lease_until=None)

# Counts for the per-user limits, written so that they use ix_futures_pending: the literal
# `status = 'pending'` (a bound parameter would not match the partial index's condition).
_PENDING_OF = text("futures.status = 'pending'")
_COUNT = select(func.count()).select_from(FutureRow.__table__)
_PENDING_SAMPLES = select(
    _COUNT.where(_PENDING_OF, _FUTURES.request_type == text("'sample'")).scalar_subquery(),
    _COUNT.where(_PENDING_OF, _FUTURES.request_type == text("'sample'"),
                 _FUTURES.owner == bindparam("owner")).scalar_subquery())
_PENDING_TRAINING = _COUNT.where(_PENDING_OF, _FUTURES.request_type != text("'sample'"),
                                 _FUTURES.owner == bindparam("owner"))

# Rows read on every request and rarely changed: served from memory for up to CACHE_TTL_S.
# touch() and add() keep the cache right for this process at once; another gateway's change on
# the same database is seen within the TTL (a session closed on one gateway is refused by the
# others at most CACHE_TTL_S later).
_CACHED = ("ModelRow", "SamplingSessionRow", "CheckpointRow", "SessionRow")
CACHE_TTL_S = 2.0
_CACHE_SWEEP_AT = 4096


def _cache_key(row) -> tuple[str, str]:
    return type(row).__name__, row.__mapper__.primary_key_from_instance(row)[0]


class Database:
    def __init__(self, url: str):
        self.engine = create_engine(url, future=True)
        if url.startswith("sqlite"):
            @event.listens_for(self.engine, "connect")
            def _sqlite_pragmas(conn, _):
                cur = conn.cursor()
                cur.execute("PRAGMA journal_mode=WAL")
                cur.execute("PRAGMA synchronous=NORMAL")
                cur.execute("PRAGMA busy_timeout=30000")
                cur.close()
        schema.upgrade(self.engine, Base.metadata)
        self._cache: dict[tuple[str, str], object] = {}

    def session(self) -> Session:
        return Session(self.engine, expire_on_commit=False)

    def add(self, row) -> None:
        with self.session() as s:
            s.add(row)
            s.commit()
        if type(row).__name__ in _CACHED:
            self._remember(_cache_key(row), row)

    def add_if_absent(self, row) -> bool:
        """Inserts `row` unless one with its primary key exists (made concurrently, perhaps by
        another gateway): False then, and the caller reads that one to decide."""
        try:
            self.add(row)
        except IntegrityError:
            return False
        return True

    def _remember(self, key: tuple[str, str], row) -> None:
        """Caches `row` for CACHE_TTL_S. Bounded: past _CACHE_SWEEP_AT entries the expired ones are
        dropped (each add caches its row, and a row never read again would stay for good)."""
        stamp = time.monotonic()
        if len(self._cache) >= _CACHE_SWEEP_AT:
            for k in [k for k, (_, until) in self._cache.items() if until <= stamp]:
                del self._cache[k]
            if len(self._cache) >= _CACHE_SWEEP_AT:      # all fresh: a stale entry is only a re-read
                self._cache.clear()
        self._cache[key] = (row, stamp + CACHE_TTL_S)

    def get(self, cls, key):
        cached = self._cache.get((cls.__name__, key))
        if cached is not None and cached[1] > time.monotonic():
            return cached[0]
        with self.session() as s:
            row = s.get(cls, key)
        if row is not None and cls.__name__ in _CACHED:
            self._remember((cls.__name__, key), row)
        elif cached is not None:
            self._cache.pop((cls.__name__, key), None)
        return row

    # Futures are the hot path: plain Core statements, no ORM unit of work.

    def insert_future(self, row: FutureRow) -> FutureRow:
        """Inserts a pending future, or returns the existing one with the same idempotency key."""
        values = {c.name: getattr(row, c.name) for c in FutureRow.__table__.columns}
        values.update(status="pending", created_at=now(), extra=row.extra or {})
        row.status = "pending"
        try:
            with self.engine.begin() as conn:
                conn.execute(_INSERT_FUTURE, values)     # prebuilt statement, parameters apart
            return row
        except IntegrityError:
            with self.session() as s:
                return s.scalars(select(FutureRow).where(FutureRow.idempotency_key == row.idempotency_key)).one()

    def finish_future(self, request_id: str, status: str, content_type: str, result: bytes) -> bool:
        """Records the result of a pending future; False if it had finished already (elsewhere)."""
        with self.engine.begin() as conn:
            return conn.execute(_FINISH_FUTURE, {"rid": request_id, "status": status, "content_type": content_type,
                                                 "result": result, "completed_at": now()}).rowcount > 0

    def future_status(self, request_id: str) -> str | None:
        with self.engine.connect() as conn:
            return conn.execute(select(_FUTURES.status).where(_FUTURES.request_id == request_id)).scalar()

    def future_type_by_key(self, idempotency_key: str) -> str | None:
        """The request type of the future submitted under this key; None if there is none."""
        with self.engine.connect() as conn:
            return conn.execute(select(_FUTURES.request_type).where(_FUTURES.idempotency_key == idempotency_key)).scalar()

    def renew_leases(self, request_ids: list[str], owner: str, until: datetime.datetime) -> None:
        """Extends the lease of the pending futures this gateway runs."""
        with self.engine.begin() as conn:
            for i in range(0, len(request_ids), 500):
                conn.execute(update(FutureRow.__table__).where(
                    _FUTURES.request_id.in_(request_ids[i:i + 500]), _FUTURES.claimed_by == owner,
                    _FUTURES.status == "pending").values(lease_until=until))

    def claim_lapsed_futures(self, owner: str, until: datetime.datetime, limit: int = 1000) -> list[FutureRow]:
        """Takes over pending futures whose lease lapsed (their gateway died), oldest first. Each
        claim is one conditional UPDATE, so of several gateways claiming at once exactly one gets
        each row (SQLite and Postgres alike)."""
        stamp = now()
        with self.session() as s:
            candidates = list(s.scalars(select(FutureRow.request_id).where(
                FutureRow.lease_until < stamp, FutureRow.status == "pending").order_by(
                FutureRow.created_at).limit(limit)))
        claimed = []
        for request_id in candidates:
            with self.engine.begin() as conn:
                n = conn.execute(update(FutureRow.__table__).where(
                    _FUTURES.request_id == request_id, _FUTURES.status == "pending",
                    _FUTURES.lease_until < stamp).values(claimed_by=owner, lease_until=until)).rowcount
            if n:
                claimed.append(request_id)
        if not claimed:
            return []
        with self.session() as s:
            return list(s.scalars(select(FutureRow).where(FutureRow.request_id.in_(claimed))))

    def delete_finished_futures(self, before: datetime.datetime) -> int:
        """Drops futures that finished before `before` (their retention ended)."""
        with self.engine.begin() as conn:
            return conn.execute(FutureRow.__table__.delete().where(_FUTURES.completed_at < before)).rowcount

    def pending_samples(self, owner: str) -> tuple[int, int]:
        """(sample futures pending on every gateway, those of `owner`): one indexed query."""
        with self.engine.connect() as conn:
            total, mine = conn.execute(_PENDING_SAMPLES, {"owner": owner}).one()
        return total, mine

    def pending_training(self, owner: str) -> int:
        """`owner`'s training futures pending on every gateway (queued or running)."""
        with self.engine.connect() as conn:
            return conn.execute(_PENDING_TRAINING, {"owner": owner}).scalar()

    def prunable_snapshots(self, unused_before: datetime.datetime, lapsed_before: datetime.datetime,
                           superseded_unused_before: datetime.datetime) -> dict[str, tuple[str, list[str]]]:
        """Ephemeral snapshots nobody can reach any more, or nobody will: snapshot_id -> (its
        recorded path, the sampling sessions that point at it). Ephemeral: made for a sampling
        session (save_weights_and_get_sampling_client), not a named checkpoint's. Prunable when
        none of its sampling sessions was used (asample) or made since `unused_before` and each of
        their sessions is closed or without a heartbeat since `lapsed_before`; or, live session or
        not, when a newer snapshot of the same model exists and none of them was used since
        `superseded_unused_before` (an RL loop leaves one such snapshot per step)."""
        ss, sess = SamplingSessionRow, SessionRow
        used = func.coalesce(ss.last_used, ss.created_at)
        live = and_(sess.finished.is_(False), sess.last_heartbeat >= lapsed_before)
        named = select(CheckpointRow.snapshot_id).where(CheckpointRow.snapshot_id != "")
        with self.session() as s:
            rows = s.execute(
                select(ss.snapshot_id, ss.snapshot_path, ss.sampling_session_id, ss.model_path.is_not(None),
                       case((used >= unused_before, True), else_=False),
                       case((live, True), else_=False),
                       case((used >= superseded_unused_before, True), else_=False))
                .outerjoin(sess, sess.session_id == ss.session_id)
                .where(ss.snapshot_id != "", ss.snapshot_id.not_in(named))
                .order_by(ss.created_at)).all()
        over_named: set[str] = set()    # also behind a sampling session made from a checkpoint's path
        held: set[str] = set()          # used lately, or a session of it is live
        used_since_superseded: set[str] = set()
        found: dict[str, tuple[str, list[str]]] = {}
        newest: dict[str, str] = {}     # model -> its newest ephemeral snapshot (rows come oldest first)
        for snapshot_id, path, sampling_session_id, from_path, used_lately, session_live, used_since_cutoff in rows:
            if from_path:
                over_named.add(snapshot_id)
                continue
            found.setdefault(snapshot_id, (path, []))[1].append(sampling_session_id)
            newest[snapshot_id.rsplit("@", 1)[0]] = snapshot_id      # snapshot ids are "<model_id>@..."
            if used_lately or session_live:
                held.add(snapshot_id)
            if used_since_cutoff:
                used_since_superseded.add(snapshot_id)
        latest = set(newest.values())
        return {sid: v for sid, v in found.items() if sid not in over_named and (
            sid not in held or (sid not in latest and sid not in used_since_superseded))}

    def delete_sampling_sessions(self, sampling_session_ids: list[str]) -> int:
        for key in sampling_session_ids:
            self._cache.pop(("SamplingSessionRow", key), None)
        with self.engine.begin() as conn:
            return conn.execute(SamplingSessionRow.__table__.delete().where(
                SamplingSessionRow.__table__.c.sampling_session_id.in_(sampling_session_ids))).rowcount

    def models_of_lapsed_sessions(self, before: datetime.datetime) -> list[str]:
        """Resident models whose session's last heartbeat is older than `before`."""
        with self.session() as s:
            return list(s.scalars(select(ModelRow.model_id).join(
                SessionRow, SessionRow.session_id == ModelRow.session_id).where(
                ModelRow.resident.is_(True), SessionRow.last_heartbeat < before)))

    def put(self, row) -> None:
        """Insert or replace by primary key."""
        with self.session() as s:
            s.merge(row)
            s.commit()
        self._cache.pop(_cache_key(row), None)

    def delete(self, cls, key) -> bool:
        self._cache.pop((cls.__name__, key), None)
        with self.session() as s:
            row = s.get(cls, key)
            if row is None:
                return False
            s.delete(row)
            s.commit()
            return True

    def select(self, stmt) -> list:
        with self.session() as s:
            return list(s.scalars(stmt))

    def count(self, stmt) -> int:
        with self.session() as s:
            return s.scalar(select(func.count()).select_from(stmt.subquery()))

    def adopt_unowned(self, owner: str) -> None:
        """Rows made before tinkerd had users (an upgraded database) become `owner`'s."""
        with self.session() as s:
            for cls in (SessionRow, ModelRow, FutureRow, SamplingSessionRow, CheckpointRow):
                s.execute(update(cls).where(cls.owner.is_(None)).values(owner=owner))
            s.commit()

    def close_session(self, session_id: str) -> bool:
        """Marks a session closed; False if it was already (of two gateways closing it at once,
        exactly one gets True: one conditional UPDATE)."""
        self._cache.pop(("SessionRow", session_id), None)
        with self.engine.begin() as conn:
            return conn.execute(update(SessionRow.__table__).where(
                SessionRow.__table__.c.session_id == session_id,
                SessionRow.__table__.c.finished.is_(False)).values(finished=True)).rowcount > 0

    def touch(self, cls, key, **values) -> bool:
        self._cache.pop((cls.__name__, key), None)
        with self.session() as s:
            pk = cls.__mapper__.primary_key[0]
            n = s.execute(update(cls).where(pk == key).values(**values)).rowcount
            s.commit()
            return n > 0
