"""Per-request spans of each session, for the console's session panels and the Perfetto trace
export (gateway/traces/pftrace.py, GET /api/v1/sessions/{id}/trace_export).

A request of a session (a training run's `<session>:train:<n>` model, or a sampling session's
`<session>:sample:<n>`) is followed from the moment its future is scheduled (received), through
the moment its job starts (started: the trainer call is made; for a sample, a sampler replica is
picked), to the moment it finishes; the jobs add which service ran it and the tokens in and out
(`note`). A 429 refusal of a session's request is an event of its own (`refusals`).

Cheap on the hot path: an open span is a small object in memory; a finished one goes to a buffer
that a background task writes every FLUSH_S as one multi-row insert (`flush`). So a request
costs no database write of its own, and every gateway on the database sees every span within
FLUSH_S. Bounded: at most `per_session` rows a session (the oldest are deleted after each
insert), at most _MAX_BUFFERED finished spans and _MAX_OPEN open ones in memory (beyond, the
oldest are dropped and counted in `dropped`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import dataclasses
import logging
import time

from sqlalchemy import delete, func, select, text

from gateway.errors import OverLimit
from gateway.storage.db import Database, FutureRow, TraceSpanRow

log = logging.getLogger(__name__)

FLUSH_S = 0.5
_MAX_BUFFERED = 20_000       # finished spans not yet written (the database is slow or down)
_MAX_OPEN = 100_000          # requests in flight; each finishes or is dropped here
_DETAIL_CHARS = 512
_ROWS = TraceSpanRow.__table__.c


def now_us() -> int:
    return time.time_ns() // 1000


def session_of(model_id: str | None, sampling_session_id: str | None) -> str | None:
    """The session a request belongs to, from the ids it names (routes make them
    `<session>:train:<n>` and `<session>:sample:<n>`); None for one of no session (OpenAI routes)."""
    for key, sep in ((model_id, ":train:"), (sampling_session_id, ":sample:")):
        if key:
            session, found, _ = key.rpartition(sep)
            if found:
                return session
    return None


@dataclasses.dataclass
class _Span:
    session_id: str
    request_id: str | None
    kind: str
    model_id: str | None
    service: str
    received_us: int
    started_us: int | None = None
    finished_us: int = 0
    status: str = ""
    tokens_in: int = 0
    tokens_out: int = 0
    detail: str = ""

    def row(self) -> dict:
        return dataclasses.asdict(self)


_current: contextvars.ContextVar[_Span | None] = contextvars.ContextVar("tinkerd_trace_span", default=None)


def note(*, service: str | None = None, started: bool = False, tokens_in: int | None = None,
         tokens_out: int | None = None) -> None:
    """What a job learns about the request it runs: the service (a sampler replica's address),
    that it starts now (a replica was picked), its tokens. A no-op outside a traced request."""
    span = _current.get()
    if span is None:
        return
    if service is not None:
        span.service = service
    if started:
        span.started_us = now_us()
    if tokens_in is not None:
        span.tokens_in = tokens_in
    if tokens_out is not None:
        span.tokens_out = tokens_out


class Traces:
    def __init__(self, db: Database, per_session: int = 10_000):
        if per_session < 1:
            raise ValueError(f"--trace-spans-per-session must be at least 1 (got {per_session})")
        self.db = db
        self.per_session = per_session
        self._open: collections.OrderedDict[str, _Span] = collections.OrderedDict()
        self._buffer: collections.deque[_Span] = collections.deque()
        self.dropped = 0

    # ---- recording (gateway/futures/store.py calls these) -----------------------------------------

    def received(self, request_id: str, request_type: str, model_id: str | None,
                 sampling_session_id: str | None) -> None:
        session_id = session_of(model_id, sampling_session_id)
        if session_id is None:
            return
        service = "sampler" if sampling_session_id else "trainer"
        self._open[request_id] = _Span(session_id, request_id, request_type, model_id, service, now_us())
        while len(self._open) > _MAX_OPEN:
            self._open.popitem(last=False)
            self.dropped += 1

    def started(self, request_id: str) -> None:
        """The job of `request_id` starts in this task: its notes go to its span."""
        span = self._open.get(request_id)
        if span is not None:
            span.started_us = now_us()
        _current.set(span)

    def finished(self, request_id: str, status: str) -> None:
        span = self._open.pop(request_id, None)
        if span is None:
            return
        span.finished_us, span.status = now_us(), status
        self._keep(span)

    @contextlib.contextmanager
    def refusals(self, session_id: str | None, kind: str):
        """Records a limit's refusal (gateway/identity/limits.py OverLimit: a 429) of a session's request."""
        try:
            yield
        except OverLimit as e:
            if session_id is not None:
                stamp = now_us()
                self._keep(_Span(session_id, None, "rate_limited", None, "", stamp, None, stamp, "refused",
                                 detail=f"{kind}: {e}"[:_DETAIL_CHARS]))
            raise

    def _keep(self, span: _Span) -> None:
        self._buffer.append(span)
        while len(self._buffer) > _MAX_BUFFERED:
            self._buffer.popleft()
            self.dropped += 1

    # ---- writing ------------------------------------------------------------------------------

    def flush(self) -> int:
        """Writes the buffered spans in one insert, then trims each session they touched to
        `per_session` rows. Returns how many were written. Runs off the event loop (to_thread)
        except in tests and at an export, which wants this gateway's spans in."""
        spans = []
        while self._buffer:
            spans.append(self._buffer.popleft())
        if not spans:
            return 0
        try:
            with self.db.engine.begin() as conn:
                conn.execute(TraceSpanRow.__table__.insert(), [s.row() for s in spans])
                for session_id in {s.session_id for s in spans}:
                    self._cap(conn, session_id)
        except Exception:  # noqa: BLE001 - a database hiccup: keep them for the next flush
            self._buffer.extendleft(reversed(spans))
            raise
        return len(spans)

    def _cap(self, conn, session_id: str) -> None:
        """At most per_session rows for the session: ids grow with each insert, so the rows past
        the newest per_session are those at or below the (per_session+1)-th newest id."""
        edge = conn.execute(select(_ROWS.span_id).where(_ROWS.session_id == session_id)
                            .order_by(_ROWS.span_id.desc()).offset(self.per_session).limit(1)).scalar()
        if edge is not None:
            conn.execute(delete(TraceSpanRow.__table__).where(_ROWS.session_id == session_id,
                                                              _ROWS.span_id <= edge))

    async def flush_forever(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_S)
            try:
                await asyncio.to_thread(self.flush)
            except Exception:  # noqa: BLE001 - retried at the next flush
                log.exception("could not write %d trace spans", len(self._buffer))

    # ---- reading ------------------------------------------------------------------------------

    def of_session(self, session_id: str, until_us: int | None = None) -> list[TraceSpanRow]:
        """The session's recorded spans (at most per_session), in record order."""
        stmt = select(TraceSpanRow).where(TraceSpanRow.session_id == session_id)
        if until_us is not None:
            stmt = stmt.where(TraceSpanRow.finished_us <= until_us)
        return self.db.select(stmt.order_by(TraceSpanRow.span_id))

    def samples_in_flight(self, session_id: str, owner: str) -> int:
        """The session's samples pending now, on every gateway: its owner's pending samples (the
        partial index of pending futures) whose key names one of its sampling sessions."""
        prefix = session_id.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + ":sample:"
        futures = FutureRow.__table__.c
        with self.db.engine.connect() as conn:
            return conn.execute(select(func.count()).select_from(FutureRow.__table__).where(
                text("futures.status = 'pending'"), futures.request_type == text("'sample'"),
                futures.owner == owner, futures.idempotency_key.like(prefix + "%", escape="\\"))).scalar()

    def delete_before(self, before_us: int) -> int:
        """Drops spans that finished before `before_us` (housekeeping: --trace-retention-s)."""
        with self.db.engine.begin() as conn:
            return conn.execute(delete(TraceSpanRow.__table__).where(_ROWS.finished_us < before_us)).rowcount
