"""Durable gateway state in a SQL database (SQLite by default, Postgres by URL): users and their
API keys, sessions, training models, futures (with their results), sampling sessions,
checkpoints, the audit log. Every row a user makes carries `owner` (their user id). The futures'
statements are their store's (gateway/futures/store.py), the per-user counts the limits'
(gateway/identity/limits.py)."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import contextvars
import datetime
import enum
import functools
import hashlib
import logging
import time
import weakref
from typing import Callable, Iterator

from sqlalchemy import (JSON, BigInteger, Boolean, DateTime, Index, Integer, LargeBinary, String, Text, and_, case,
                        create_engine, event, func, literal, or_, select, text, update)
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.exc import ArgumentError, IntegrityError, NoSuchModuleError, OperationalError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from gateway.storage import schema
from tinkerd.errors import UserError

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
    # The project it is listed in (gateway/projects.py; its owner's default project unless named),
    # and a name for people; search_sessions walks the indexes below newest first.
    project_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    display_name: Mapped[str | None] = mapped_column(String(512), nullable=True)
    # How its client said it ended (ServiceClient.close): success | errored | interrupted.
    finish_reason: Mapped[str | None] = mapped_column(String(16), nullable=True)
    finish_detail: Mapped[str | None] = mapped_column(Text, nullable=True)
    __table_args__ = (Index("ix_sessions_created", "created_at", "session_id"),
                      Index("ix_sessions_owner_created", "owner", "created_at", "session_id"),
                      Index("ix_sessions_project_created", "project_id", "created_at", "session_id"))


class ProjectRow(Base):
    """A project sessions are grouped in (gateway/projects.py), made when first named. Who may
    list it: the user who made it, the users whose sessions are in it, and their org's admins."""
    __tablename__ = "projects"
    project_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    org_id: Mapped[str] = mapped_column(String(128))
    created_by: Mapped[str] = mapped_column(String(64), index=True)
    created_at: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True), default=now)


class ModelRow(Base):
    __tablename__ = "models"
    model_id: Mapped[str] = mapped_column(String(256), primary_key=True)
    session_id: Mapped[str] = mapped_column(String(128), index=True)
    owner: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)
    base_model: Mapped[str] = mapped_column(String(512))
    lora_rank: Mapped[int] = mapped_column(Integer)
    lora_config: Mapped[dict] = mapped_column(JSON)
    # Chosen at creation, fixed for the run's life: "adamw" or "dimuon" (tinkerd/optimizers.py).
    optimizer: Mapped[str] = mapped_column(String(16), server_default="adamw")
    created_at: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True), default=now)
    last_request_time: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True), default=now)
    # False once unloaded for a lapsed session; the trainer reloads it on next use.
    resident: Mapped[bool] = mapped_column(Boolean, default=True)


class Status(enum.StrEnum):
    """A future's state (its row's `status`, stored as the string)."""
    PENDING = "pending"
    COMPLETE = "complete"
    FAILED = "failed"


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
    status: Mapped[str] = mapped_column(String(16), default=Status.PENDING)
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
    # The per-user limits count pending futures (gateway/identity/limits.py): a partial index holds only
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
    # An ephemeral snapshot's bytes on disk (the trainer's reply), counted in its owner's
    # --max-checkpoint-gb-per-user; NULL for the base model and a checkpoint's path.
    snapshot_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # An inflight sampling client's (save_weights_and_get_sampling_client(kind="inflight")): it samples
    # the training model's newest inflight save (InflightTargetRow); its own snapshot is the one
    # saved when it was made, the oldest weights it may be served. NULL: a snapshot client.
    inflight_model_id: Mapped[str | None] = mapped_column(String(256), nullable=True)
    # Clones that joined it (join_sampling_session): the last clone id handed out (0: the original's).
    clones: Mapped[int] = mapped_column(BigInteger, server_default="0", default=0)


class InflightTargetRow(Base):
    """A training model's shared inflight weights: the snapshot of its newest inflight save,
    which every inflight sampling client of the model samples. Only a later save replaces it (a
    model's saves run in seq_id order), so a client never goes back to older weights."""
    __tablename__ = "inflight_targets"
    model_id: Mapped[str] = mapped_column(String(256), primary_key=True)
    seq_id: Mapped[int] = mapped_column(BigInteger)            # the save's
    snapshot_id: Mapped[str] = mapped_column(String(256))
    snapshot_path: Mapped[str] = mapped_column(Text)
    updated_at: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True), default=now)


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
    # Record order: a user's caps drop their lowest ids first.
    __table_args__ = (Index("ix_stability_records_owner", "owner", "record_id"),)
    record_id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True,
                                           autoincrement=True)
    sequence_id: Mapped[str] = mapped_column(String(128), unique=True)      # "<request_id>:<i>"
    session_id: Mapped[str] = mapped_column(String(128))                    # whose: only it may use it
    owner: Mapped[str] = mapped_column(String(128), server_default="")      # the session's user: capped per user
    size_bytes: Mapped[int] = mapped_column(BigInteger, server_default="0")  # what the record costs, counted
    tokens: Mapped[bytes] = mapped_column(LargeBinary)                      # int64, the sampled tokens
    logprobs: Mapped[bytes] = mapped_column(LargeBinary)                    # float32, the sampler's
    used: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True), default=now, index=True)


class CompletionRow(Base):
    """A finished sample not yet acknowledged by its sampling session's retrieve_futures poller
    (gateway/futures/completions.py). Written in the transaction that finishes the sample, so it
    is there for a poll on any gateway; deleted once acknowledged or its payload fetched. `seq`
    orders a target's rows; `reported_cursor` is the cursor of the last poll answer that held the
    row (NULL: not reported yet), which that poll's successor acknowledges."""
    __tablename__ = "completions"
    seq: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True,
                                     autoincrement=True)
    sampling_session_id: Mapped[str] = mapped_column(String(128))
    clone: Mapped[int] = mapped_column(BigInteger)
    request_id: Mapped[str] = mapped_column(String(64), index=True)
    failed: Mapped[bool] = mapped_column(Boolean)
    size: Mapped[int] = mapped_column(BigInteger)           # the payload's bytes (the SDK reserves them)
    reported_cursor: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    finished_at: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True), default=now, index=True)
    # AUTOINCREMENT: SQLite reuses the highest rowid once its row is deleted, and a watcher that
    # reads the rows above the highest seq it saw would miss the row that reused it.
    __table_args__ = (Index("ix_completions_target", "sampling_session_id", "clone", "seq"),
                      {"sqlite_autoincrement": True})


class TraceSpanRow(Base):
    """One request of a session as it went through the gateway (gateway/traces/spans.py), or a
    rate-limit refusal (kind "rate_limited", no request_id): what the console's session panels
    and the Perfetto trace export are made of. Written once, when the request finished; at most
    --trace-spans-per-session rows a session (the oldest go first). Times in microseconds
    since the epoch."""
    __tablename__ = "trace_spans"
    # Record order: the per-session cap drops the lowest ids (an index range, not a scan).
    span_id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True,
                                         autoincrement=True)
    session_id: Mapped[str] = mapped_column(String(128))
    request_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    kind: Mapped[str] = mapped_column(String(64))             # the request type, or "rate_limited"
    model_id: Mapped[str | None] = mapped_column(String(256), nullable=True)
    service: Mapped[str] = mapped_column(String(256), default="")    # "trainer", "sampler <address>"
    status: Mapped[str] = mapped_column(String(16))           # complete | failed | cancelled | refused
    received_us: Mapped[int] = mapped_column(BigInteger)
    started_us: Mapped[int | None] = mapped_column(BigInteger, nullable=True)    # NULL: never ran
    finished_us: Mapped[int] = mapped_column(BigInteger, index=True)     # retention deletes by it
    tokens_in: Mapped[int] = mapped_column(Integer, default=0)      # trained tokens, or the prompt's
    tokens_out: Mapped[int] = mapped_column(Integer, default=0)     # sampled tokens
    detail: Mapped[str] = mapped_column(String(512), default="")    # a refusal's message
    __table_args__ = (Index("ix_trace_spans_session", "session_id", "span_id"),)


class UsageRow(Base):
    """One hour's usage of one kind by one session of one user on one base model (gateway/usage.py):
    tokens trained, prefilled or sampled, or checkpoints made. `project_id` is the session's
    current project (moving the session moves its usage), kept here so a pruned session's usage
    still names it."""
    __tablename__ = "usage"
    bucket_start: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True), primary_key=True)
    owner: Mapped[str] = mapped_column(String(64), primary_key=True)
    session_id: Mapped[str] = mapped_column(String(128), primary_key=True)       # "": none (OpenAI routes)
    base_model: Mapped[str] = mapped_column(String(512), primary_key=True)
    kind: Mapped[str] = mapped_column(String(32), primary_key=True)   # training | sampling_prefill | ...
    cached: Mapped[bool] = mapped_column(Boolean, primary_key=True)
    quantity: Mapped[int] = mapped_column(BigInteger)
    project_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    __table_args__ = (Index("ix_usage_session", "session_id"),)


class UsageCountedRow(Base):
    """A piece of work whose usage was counted (its request's key): a request run again (re-driven
    by another gateway, answered again by a restarted service) is not counted twice."""
    __tablename__ = "usage_counted"
    key: Mapped[str] = mapped_column(String(512), primary_key=True)
    at: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True), index=True)


class CheckpointStorageRow(Base):
    """A checkpoint's bytes on disk from when it was written (`since`: its row's created_at) until it
    was deleted, expired or overwritten (`until`; NULL while it lasts): storage in GB-hours."""
    __tablename__ = "checkpoint_storage"
    tinker_path: Mapped[str] = mapped_column(String(768), primary_key=True)
    since: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True), primary_key=True)
    until: Mapped[datetime.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True, index=True)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    owner: Mapped[str] = mapped_column(String(64))
    session_id: Mapped[str] = mapped_column(String(128), index=True)
    base_model: Mapped[str] = mapped_column(String(512))


class WeightsAccessTokenRow(Base):
    """A token with which another user may load or copy one checkpoint (gateway/access_tokens.py):
    `wat-<token_id>-<secret>`, stored as the SHA-256 of its secret, as API keys are. It grants
    that checkpoint as it was when the token was made (`generation`), until it expires or is revoked."""
    __tablename__ = "weights_access_tokens"
    token_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    secret_sha256: Mapped[str] = mapped_column(String(64))
    tinker_path: Mapped[str] = mapped_column(String(768), index=True)
    generation: Mapped[str] = mapped_column(String(64))
    owner: Mapped[str] = mapped_column(String(64), index=True)
    created_at: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True), default=now)
    expires_at: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True))
    revoked_at: Mapped[datetime.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


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


class ExportPlaceRow(Base):
    """A merged export being made (gateway/export.py): one row per download, counted per checkpoint
    owner on every gateway; a gateway renews its rows' leases while it streams, and a row whose
    lease lapsed (its gateway gone) no longer counts."""
    __tablename__ = "export_places"
    place_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    owner: Mapped[str] = mapped_column(String(64), index=True)
    lease_until: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True))


@event.listens_for(ModelRow, "after_delete")
def _delete_step_metrics(_mapper, connection, row: ModelRow) -> None:
    """A run's metrics go with it (no foreign key: SQLite would enforce it only with a pragma)."""
    connection.execute(StepMetricRow.__table__.delete().where(StepMetricRow.__table__.c.model_id == row.model_id))


_MODELS = ModelRow.__table__.c
_SESSIONS = SessionRow.__table__.c
_SAMPLING = SamplingSessionRow.__table__.c
_CHECKPOINTS = CheckpointRow.__table__.c
# A user's turn to write a row counted against their limits (Database.owner_turn), held to the commit.
_LOCK_OWNER = text("SELECT pg_advisory_xact_lock(:key)")


def _owner_lock_key(owner: str) -> int:
    """A Postgres advisory lock key (signed 64 bits) per user."""
    return int.from_bytes(hashlib.sha256(b"tinkerd-limits\0" + owner.encode()).digest()[:8], "big", signed=True)

# Rows read on every request and rarely changed: served from memory for up to CACHE_TTL_S.
# touch() and add() keep the cache right for this process at once; another gateway's change on
# the same database is seen within the TTL (a session closed on one gateway is refused by the
# others at most CACHE_TTL_S later).
_CACHED = ("ModelRow", "SamplingSessionRow", "CheckpointRow", "SessionRow")
CACHE_TTL_S = 2.0
_CACHE_SWEEP_AT = 4096


def _cache_key(row) -> tuple[str, str]:
    return type(row).__name__, row.__mapper__.primary_key_from_instance(row)[0]


def encodable(text: str) -> bool:
    """False for a lone surrogate from JSON: no row has it, and no driver takes it."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


class DatabaseUnusable(UserError):
    """--db-url names no database this gateway can open; the message says why (never the password)."""


def shown(url: str) -> str:
    """A database URL as a message may show it: without its password."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return "(not shown: it does not parse, and may hold a password)"


def _pool_order(url: str) -> dict:
    """LIFO, where the pool is a queue (a server's, or an SQLite file's; an in-memory SQLite
    database has one connection a thread): the database thread gets back the connection it just
    used. SQLite drops a connection's page cache when another connection committed since; FIFO
    handed out the pool's connections in turn, so every transaction began by re-reading its pages."""
    parsed = make_url(url)
    in_memory = parsed.get_backend_name() == "sqlite" and (parsed.database in (None, "", ":memory:")
                                                           or parsed.query.get("mode") == "memory")
    return {} if in_memory else {"pool_use_lifo": True}


def _answer(loop, answer_ref: weakref.ref, context: contextvars.Context, fn, args, kwargs) -> None:
    """On a database thread: runs `fn` and hands what it returned or raised to the answer.
    An error's traceback holds this frame and, through it, the pool's work item: so the item
    holds the answer only weakly (its caller holds it while it waits), and this frame lets go
    of it, or the answer, its error and the caller's arguments would keep each other alive until
    a full collection (the gateway freezes its heap: those are rare)."""
    try:
        result = context.run(fn, *args, **kwargs)
    except BaseException as e:         # every failure goes to the caller that awaits it
        answer = answer_ref()
        if answer is not None:
            loop.call_soon_threadsafe(_settle, answer, None, e)
        answer = None
    else:
        answer = answer_ref()
        if answer is not None:
            loop.call_soon_threadsafe(_settle, answer, result, None)


def _cancel_if_cancelled(work: concurrent.futures.Future, answer: asyncio.Future) -> None:
    if answer.cancelled():
        work.cancel()             # not started yet: it never will; started: it runs to its end


def _settle(answer: asyncio.Future, result, error: BaseException | None) -> None:
    if answer.cancelled():
        return
    if error is not None:
        answer.set_exception(error)
    else:
        answer.set_result(result)


def _settle_all(answers: list[asyncio.Future], results: list) -> None:
    for answer, result in zip(answers, results):
        if isinstance(result, BaseException):
            _settle(answer, None, result)
        else:
            _settle(answer, result, None)


class _Gathered:
    """The calls of one `Database.together` function waiting for a database thread, and whether
    one is on its way to take them."""

    def __init__(self):
        self.waiting: collections.deque[tuple[object, asyncio.Future]] = collections.deque()
        self.scheduled = False


class Database:
    def __init__(self, url: str, idle_in_transaction_s: float = 10.0):
        """`idle_in_transaction_s` (Postgres): how long the server waits on this gateway in the
        middle of a transaction before it ends the transaction and frees its locks."""
        try:
            self.engine = create_engine(url, future=True, **_pool_order(url))
        except (ArgumentError, NoSuchModuleError, ImportError) as e:
            raise DatabaseUnusable(f"--db-url {shown(url)} is not a database URL this gateway can use "
                                   f"({type(e).__name__}: {str(e).splitlines()[0]}); e.g. postgresql+psycopg://"
                                   f"USER@HOST/DB, or none for SQLite in the state dir") from None
        if url.startswith("sqlite"):
            @event.listens_for(self.engine, "connect")
            def _sqlite_pragmas(conn, _):
                cur = conn.cursor()
                cur.execute("PRAGMA journal_mode=WAL")
                cur.execute("PRAGMA synchronous=NORMAL")
                cur.execute("PRAGMA busy_timeout=30000")
                cur.close()
        try:
            schema.upgrade(self.engine, Base.metadata)
        except OperationalError as e:
            raise DatabaseUnusable(f"cannot open the database at {shown(url)}: {str(e.orig).strip().splitlines()[0]}"
                                   ) from None
        if self.engine.dialect.name == "postgresql":
            self._end_silent_transactions(idle_in_transaction_s)
        self._cache: dict[tuple[str, str], object] = {}
        # SQLite: one writer at a time, so writes may share a transaction (`together` gathers
        # them) and cannot deadlock; a server's threads write side by side.
        self.one_writer = url.startswith("sqlite")
        # The threads the event loop hands its database work to (`run`): one for SQLite, whose
        # writers take turns anyway (several would only wait on its lock), more for a server.
        self._threads = concurrent.futures.ThreadPoolExecutor(
            max_workers=1 if self.one_writer else 8, thread_name_prefix="db")
        self._gathered: dict[Callable, _Gathered] = {}

    def _end_silent_transactions(self, after_s: float) -> None:
        """A gateway cut off from Postgres mid-transaction (a partition, a frozen host) keeps its
        locks -- a user's or the server-wide sample admission lock (owner_turn, limits.samples_turn) --
        until the server sees the peer is gone: hours with the kernel's keepalive defaults, while
        every other gateway's admissions wait on them. Each connection of this gateway asks the
        server to end its transaction once it has waited `after_s` on it, in one statement or
        between two (our transactions run back to back, in milliseconds). Set after the schema's
        migrations, which may take their time between statements."""
        ms = max(1, int(after_s * 1000))

        @event.listens_for(self.engine, "connect")
        def _bounded_silence(conn, _):
            cur = conn.cursor()
            cur.execute(f"SET idle_in_transaction_session_timeout = {ms}")
            cur.execute(f"SET tcp_user_timeout = {ms}")
            cur.close()
            conn.commit()
        self.engine.dispose()      # the migrations' connections, opened without it

    async def run(self, fn, *args, **kwargs):
        """`fn(*args, **kwargs)` on the database's threads: the event loop only awaits it, and a
        database that stops answering stalls these threads, not the loop (healthz still answers).
        Its answer comes back by one call_soon_threadsafe, not run_in_executor's chain of two
        futures and their callbacks (every future's row goes through here: what that saves,
        docs/benchmarks.md#request_costs). A caller cancelled before `fn` starts cancels it, as
        run_in_executor would."""
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        work = self._threads.submit(_answer, loop, weakref.ref(answer), contextvars.copy_context(), fn, args, kwargs)
        answer.add_done_callback(functools.partial(_cancel_if_cancelled, work))
        try:
            return await answer
        finally:
            answer = work = None          # an error's traceback holds this frame (see _answer)

    async def together(self, many: Callable[[list], list], item):
        """`many([item, ...])` on the database's threads, called once for this item and every
        other one given to the same `many` while none of the threads was free to take them: so
        their writes share one transaction, one commit (a group commit; what it saves:
        docs/benchmarks.md#request_costs). `many` answers each item in order: its result, or
        the exception that item alone raised, which is raised here. On a database server, whose
        threads would otherwise wait while one of them wrote what was gathered, each item alone."""
        if not self.one_writer:
            result, = await self.run(many, [item])
            if isinstance(result, BaseException):
                raise result
            return result
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        gathered = self._gathered.get(many)
        if gathered is None:
            gathered = self._gathered[many] = _Gathered()
        gathered.waiting.append((item, answer))
        if not gathered.scheduled:
            gathered.scheduled = True
            try:
                self._threads.submit(self._take_together, loop, many, gathered)
            except BaseException:         # no thread to take it (shut down): later calls still send one
                gathered.scheduled = False
                gathered.waiting.remove((item, answer))
                raise
        try:
            return await answer
        finally:
            answer = None                 # an error's traceback holds this frame (see _answer)

    @staticmethod
    def _take_together(loop, many: Callable[[list], list], gathered: _Gathered) -> None:
        """On a database thread: every item waiting for `many`, at once. (`scheduled` is cleared
        before the queue is emptied: an item added meanwhile is taken now, or sends a thread.)"""
        gathered.scheduled = False
        taken = []
        while gathered.waiting:
            item, answer = gathered.waiting.popleft()
            if not answer.cancelled():    # as run's: a caller cancelled before its work started cancels it
                taken.append((item, answer))
        if not taken:
            return
        try:
            results = many([item for item, _ in taken])
        except BaseException as e:    # noqa: BLE001 - every caller hears it
            log.exception("%s failed for %d calls", getattr(many, "__qualname__", many), len(taken))
            results = [e.with_traceback(None)] * len(taken)     # its frames would hold every item
        loop.call_soon_threadsafe(_settle_all, [answer for _, answer in taken], results)

    def session(self) -> Session:
        return Session(self.engine, expire_on_commit=False)

    def add(self, row) -> None:
        with self.session() as s:
            s.add(row)
            s.commit()
        if type(row).__name__ in _CACHED:
            self._remember(_cache_key(row), row)

    def next_clone(self, sampling_session_id: str) -> int:
        """A clone id of the sampling session no other clone got (one atomic increment)."""
        table = SamplingSessionRow.__table__
        with self.engine.begin() as conn:
            return conn.execute(update(table).where(table.c.sampling_session_id == sampling_session_id)
                                .values(clones=table.c.clones + 1).returning(table.c.clones)).scalar_one()

    def add_if_absent(self, row) -> bool:
        """Inserts `row` unless one with its primary key exists (made concurrently, perhaps by
        another gateway): False then, and the caller reads that one to decide."""
        try:
            self.add(row)
        except IntegrityError:
            return False
        return True

    def add_admitted(self, row, admit: Callable[[Connection], None]) -> bool:
        """Inserts `row` (a user's: it has `owner`) if `admit(conn)`, run in the same transaction
        with the row counted, does not raise (Database.owner_turn); False, with nothing written,
        if a row with its primary key exists."""
        table = type(row).__table__
        values = {c.key: getattr(row, c.key) for c in table.columns if getattr(row, c.key) is not None}
        try:
            with self.owner_turn(row.owner) as conn:
                conn.execute(table.insert(), values)
                admit(conn)
        except IntegrityError:
            return False
        self._cache.pop(_cache_key(row), None)
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

    def cached(self, cls, key):
        """The row if this process read or wrote it within CACHE_TTL_S, else None: memory only."""
        found = self._cache.get((cls.__name__, key))
        return found[0] if found is not None and found[1] > time.monotonic() else None

    def get(self, cls, key):
        row = self.cached(cls, key)
        if row is not None:
            return row
        if isinstance(key, str) and not encodable(key):
            return None
        with self.session() as s:
            row = s.get(cls, key)
        if row is not None and cls.__name__ in _CACHED:
            self._remember((cls.__name__, key), row)
        else:
            self._cache.pop((cls.__name__, key), None)      # an expired entry of a row gone
        return row

    async def row(self, cls, key):
        """`get` for the event loop: from the row cache at once, else read on the database's threads."""
        row = self.cached(cls, key)
        return row if row is not None else await self.run(self.get, cls, key)

    @contextlib.contextmanager
    def owner_turn(self, owner: str) -> Iterator[Connection]:
        """A transaction in which one of `owner`'s new rows is written and then their limits are
        counted with it (gateway/identity/limits.py), one such transaction per user at a time on every
        gateway, so a burst cannot pass a limit between a count and an insert. Postgres: a
        per-user advisory lock, held to the commit. SQLite: the insert takes the database's write
        lock (the caller writes before it counts), which every other writer waits for."""
        with self.engine.begin() as conn:
            if conn.dialect.name == "postgresql":
                conn.execute(_LOCK_OWNER, {"key": _owner_lock_key(owner)})
            yield conn

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
        """Resident models whose session's last heartbeat is older than `before` and that no
        request has used since then either: a client whose heartbeats run late while its requests
        still arrive keeps its model (unloaded between a forward_backward and its optim_step, the
        gradients would be lost)."""
        with self.session() as s:
            return list(s.scalars(select(ModelRow.model_id).join(
                SessionRow, SessionRow.session_id == ModelRow.session_id).where(
                ModelRow.resident.is_(True), SessionRow.last_heartbeat < before,
                ModelRow.last_request_time < before)))

    def put(self, row) -> None:
        """Insert or replace by primary key."""
        with self.session() as s:
            s.merge(row)
            s.commit()
        self.forget(row)

    def forget(self, row) -> None:
        """`row` was written in a transaction of the caller's: read afresh next time."""
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
            # Sessions from before projects: their owner's default project (gateway/projects.py).
            name = select(UserRow.name).where(UserRow.user_id == SessionRow.owner).scalar_subquery()
            s.execute(update(SessionRow).where(SessionRow.project_id.is_(None), SessionRow.owner.is_not(None))
                      .values(project_id=literal("default-") + name))
            s.commit()

    def close_session(self, session_id: str, reason: str | None = None, detail: str | None = None) -> bool:
        """Marks a session closed, with its client's `reason` and `detail` if given; False if it
        was already (of two gateways closing it at once, exactly one gets True: one conditional
        UPDATE). Its last_heartbeat becomes the time it closed, from which its row is kept for
        --closed-session-retention-s."""
        self._cache.pop(("SessionRow", session_id), None)
        with self.engine.begin() as conn:
            return conn.execute(update(SessionRow.__table__).where(
                SessionRow.__table__.c.session_id == session_id,
                SessionRow.__table__.c.finished.is_(False)).values(
                finished=True, last_heartbeat=now(), finish_reason=reason, finish_detail=detail)).rowcount > 0

    def prune_closed_sessions(self, closed_before: datetime.datetime, limit: int = 500) -> list[str]:
        """Deletes sessions closed before `closed_before` whose runs hold no checkpoint (those are
        kept with the checkpoints, which the disk quota bounds): the session's row, its runs
        (with their step metrics) and its sampling sessions over the base model or a checkpoint's
        path. Its ephemeral snapshots go by housekeeping.prune_snapshots, which finds them
        unreachable now. Returns the sessions deleted."""
        has_checkpoint = select(_MODELS.model_id).select_from(ModelRow.__table__.join(
            CheckpointRow.__table__, _CHECKPOINTS.model_id == _MODELS.model_id)).where(
            _MODELS.session_id == _SESSIONS.session_id).exists()
        with self.engine.begin() as conn:
            ids = list(conn.execute(select(_SESSIONS.session_id).where(
                _SESSIONS.finished.is_(True), _SESSIONS.last_heartbeat < closed_before, ~has_checkpoint)
                .limit(limit)).scalars())
            if not ids:
                return []
            runs = list(conn.execute(select(_MODELS.model_id).where(_MODELS.session_id.in_(ids))).scalars())
            metrics = StepMetricRow.__table__
            for i in range(0, len(runs), 500):
                conn.execute(metrics.delete().where(metrics.c.model_id.in_(runs[i:i + 500])))
            conn.execute(ModelRow.__table__.delete().where(_MODELS.session_id.in_(ids)))
            conn.execute(SamplingSessionRow.__table__.delete().where(
                _SAMPLING.session_id.in_(ids), or_(_SAMPLING.snapshot_id == "", _SAMPLING.model_path.is_not(None))))
            conn.execute(SessionRow.__table__.delete().where(_SESSIONS.session_id.in_(ids)))
        for key in ids:
            self._cache.pop(("SessionRow", key), None)
        for key in runs:
            self._cache.pop(("ModelRow", key), None)
        return ids

    def touch(self, cls, key, **values) -> bool:
        self._cache.pop((cls.__name__, key), None)
        with self.session() as s:
            pk = cls.__mapper__.primary_key[0]
            n = s.execute(update(cls).where(pk == key).values(**values)).rowcount
            s.commit()
            return n > 0
