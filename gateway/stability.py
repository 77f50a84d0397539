"""Stability records for `stable_reinforce`: what the sampler produced, kept by `sequence_id`.

A sampling client made with `record_stability_info=True` has every sampled sequence recorded
here (its tokens and the sampler's logprobs). A `stable_reinforce` forward_backward names,
through the datum's provenance spans, which sampled sequence each target position reproduces;
the trainer then gets the sampler's own logprobs for those positions (not whatever the client
sent), and a span whose tokens differ from what was sampled is refused. Records belong to the
session that sampled them and expire after a period without use, as in Tinker. They are rows of
the database, so a step that reaches any gateway finds what was sampled through another. Each
user's records are capped in bytes and in rows (their oldest go first): one user's sampling
cannot push out anyone else's. A user's rows are counted (a walk over all of them) when what this
gateway recorded for them since it last counted could take them past a cap, or comes to a
sixteenth of one: an RL loop records 128 sequences a step, and a count on every sample made each
step's cost grow with the run. So a user holds at most a cap plus a sixteenth of it per other
gateway.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import threading

import numpy as np
from sqlalchemy import delete, func, select, update
from sqlalchemy.exc import IntegrityError

from gateway.storage.db import Database, SessionRow, StabilityRecordRow, now
from tinkerd.errors import UserError

log = logging.getLogger(__name__)
_ROWS = StabilityRecordRow.__table__.c
_ROW_BYTES = 200          # what a record costs beyond its arrays: ids, timestamps, indexes


@dataclasses.dataclass
class _Record:
    tokens: np.ndarray        # int64, the sampled tokens
    logprobs: np.ndarray      # float32, the sampler's logprob of each


@dataclasses.dataclass(frozen=True)
class Span:
    """One run of a datum's loss_fn_input_spans: `length` positions that are positions
    [offset, offset + length) of a sampled sequence (sampled=True) or of a request's prompt."""
    sampled: bool
    sequence_id: str
    offset: int
    length: int


class StabilityRecords:
    """The records, in the database's stability_records table: any gateway finds what another
    one recorded. Each user (the sampling session's owner) keeps at most `max_bytes_per_user` of
    records and `max_sequences_per_user` of them, the oldest recorded going first; those unused
    for ttl_s are dropped by expire() (housekeeping, on every gateway)."""

    def __init__(self, db: Database, ttl_s: float = 3600.0, max_bytes_per_user: int = 256 << 20,
                 max_sequences_per_user: int = 100_000):
        self.db = db
        self.ttl_s = ttl_s
        self.max_bytes_per_user = max_bytes_per_user
        self.max_sequences_per_user = max_sequences_per_user
        # owner -> (rows, bytes) when last counted here, (rows, bytes) recorded here since.
        self._counted: dict[str, tuple[int, int, int, int]] = {}
        self._counting = threading.Lock()     # record_all runs on the database's threads

    def __len__(self) -> int:
        with self.db.engine.connect() as conn:
            return conn.execute(select(func.count()).select_from(StabilityRecordRow.__table__)).scalar()

    def held_by(self, owner: str) -> tuple[int, int]:
        """(records, bytes) the user holds."""
        with self.db.engine.connect() as conn:
            return self._held(conn, owner)

    def record(self, session_id: str, sequence_id: str, tokens, logprobs) -> None:
        self.record_all(session_id, {sequence_id: (tokens, logprobs)})

    def record_all(self, session_id: str, sequences: dict) -> None:
        """Records sequence_id -> (tokens, logprobs) for the session, in one transaction; a
        sequence recorded again (a re-driven sample) replaces its record. On the database's
        threads (Database.run)."""
        if not sequences:
            return
        stamp = now()
        with self.db.engine.connect() as conn:
            owner = conn.execute(select(SessionRow.owner).where(SessionRow.session_id == session_id)).scalar()
        owner = owner or session_id       # (a session without an owner: capped on its own)
        rows = []
        for sid, (tokens, logprobs) in sequences.items():
            tokens = np.asarray(tokens, dtype="<i8").tobytes()
            logprobs = np.asarray(logprobs, dtype="<f4").tobytes()
            rows.append({"sequence_id": sid, "session_id": session_id, "owner": owner, "used": stamp,
                         "tokens": tokens, "logprobs": logprobs,
                         "size_bytes": len(tokens) + len(logprobs) + len(sid) + _ROW_BYTES})
        try:
            with self.db.engine.begin() as conn:
                conn.execute(delete(StabilityRecordRow.__table__).where(_ROWS.sequence_id.in_(list(sequences))))
                conn.execute(StabilityRecordRow.__table__.insert(), rows)
                self._cap(conn, owner, len(rows), sum(r["size_bytes"] for r in rows))
        except IntegrityError:       # another gateway recorded the same sequences at this moment
            log.warning("stability records of %s were recorded concurrently elsewhere; kept theirs", list(sequences))

    @staticmethod
    def _held(conn, owner: str) -> tuple[int, int]:
        count, size = conn.execute(select(func.count(), func.coalesce(func.sum(_ROWS.size_bytes), 0))
                                   .where(_ROWS.owner == owner)).one()
        return int(count), int(size)

    def _cap(self, conn, owner: str, added_rows: int, added_bytes: int) -> None:
        """Drops the user's oldest records once over either cap, down to 7/8 of it (so the next
        few records do not each walk the user's rows again); counts them only when what was
        added here since the last count could matter (the module's docstring)."""
        rows_cap, bytes_cap = self.max_sequences_per_user, self.max_bytes_per_user
        with self._counting:
            counted = self._counted.get(owner)
            if counted is not None:
                rows, size, new_rows, new_bytes = counted
                new_rows, new_bytes = new_rows + added_rows, new_bytes + added_bytes
                if (rows + new_rows <= rows_cap and size + new_bytes <= bytes_cap
                        and new_rows <= rows_cap // 16 and new_bytes <= bytes_cap // 16):
                    self._counted[owner] = (rows, size, new_rows, new_bytes)
                    return
        count, size = self._held(conn, owner)
        with self._counting:
            self._counted[owner] = (count, size, 0, 0)
        if count <= rows_cap and size <= bytes_cap:
            return
        keep_rows, keep_bytes = self.max_sequences_per_user * 7 // 8, self.max_bytes_per_user * 7 // 8
        kept_rows = kept_bytes = 0
        newest_first = conn.execute(select(_ROWS.record_id, _ROWS.size_bytes).where(_ROWS.owner == owner)
                                    .order_by(_ROWS.record_id.desc()))
        for record_id, row_bytes in newest_first:
            kept_rows, kept_bytes = kept_rows + 1, kept_bytes + row_bytes
            if kept_rows > max(keep_rows, 1) or kept_bytes > keep_bytes:
                newest_first.close()
                conn.execute(delete(StabilityRecordRow.__table__).where(_ROWS.owner == owner,
                                                                         _ROWS.record_id <= record_id))
                with self._counting:
                    self._counted[owner] = (kept_rows - 1, kept_bytes - row_bytes, 0, 0)
                return

    def expire(self) -> int:
        """Drops records unused for ttl_s; returns how many."""
        cutoff = now() - datetime.timedelta(seconds=self.ttl_s)
        with self.db.engine.begin() as conn:
            return conn.execute(delete(StabilityRecordRow.__table__).where(_ROWS.used < cutoff)).rowcount

    def _lookup(self, session_id: str, spans: list[Span]) -> dict[str, _Record]:
        """The session's records the sampled spans name (another session's are as absent as
        missing ones), marked used now."""
        wanted = sorted({s.sequence_id for s in spans if s.sampled})
        if not wanted:
            return {}
        mine = (_ROWS.session_id == session_id, _ROWS.sequence_id.in_(wanted))
        with self.db.engine.begin() as conn:
            rows = conn.execute(select(_ROWS.sequence_id, _ROWS.tokens, _ROWS.logprobs).where(*mine)).all()
            conn.execute(update(StabilityRecordRow.__table__).where(*mine).values(used=now()))
        return {sid: _Record(np.frombuffer(tokens, "<i8"), np.frombuffer(logprobs, "<f4"))
                for sid, tokens, logprobs in rows}

    def behaviour_logprobs(self, session_id: str, datum: int, spans: list[Span], targets: np.ndarray,
                           client_logprobs: np.ndarray | None, found: dict[str, _Record] | None = None) -> np.ndarray:
        """The sampler's logprob for every target position a sampled span covers; positions
        covered by prompt spans keep the client's value (0 where it sent none). `found`: the
        session's records, looked up already (apply looks up a whole request's at once)."""
        where = f"datum {datum}"
        if not spans:
            raise UserError(f"{where}: stable_reinforce needs provenance (Datum.with_provenance) naming the "
                            f"sampled sequences, sampled with record_stability_info=True")
        if sum(s.length for s in spans) != len(targets):
            raise UserError(f"{where}: loss_fn_input_spans cover {sum(s.length for s in spans)} positions but "
                            f"target_tokens has {len(targets)}")
        found = self._lookup(session_id, spans) if found is None else found
        out = (np.zeros(len(targets), np.float32) if client_logprobs is None
               else np.asarray(client_logprobs, np.float32).reshape(-1).copy())
        pos = 0
        for span in spans:
            if span.sampled:
                out[pos:pos + span.length] = self._sampled(where, found.get(span.sequence_id), span,
                                                           targets[pos:pos + span.length], pos)
            pos += span.length
        return out

    def _sampled(self, where: str, rec: _Record | None, span: Span, targets: np.ndarray, pos: int) -> np.ndarray:
        """The recorded logprobs of a sampled span whose targets are the tokens sampled there."""
        if rec is None:
            raise UserError(f"{where}: no stability record for sequence {span.sequence_id!r} in this "
                            f"session (sample with record_stability_info=True; records expire after "
                            f"{self.ttl_s:.0f} s unused)")
        end = span.offset + span.length
        if end > len(rec.tokens):
            raise UserError(f"{where}: span [{span.offset}, {end}) is past the {len(rec.tokens)} tokens "
                            f"sampled in {span.sequence_id!r}")
        if not np.array_equal(rec.tokens[span.offset:end], targets):
            raise UserError(f"{where}: target_tokens [{pos}, {pos + span.length}) are not the tokens "
                            f"sampled at [{span.offset}, {end}) of {span.sequence_id!r}")
        return rec.logprobs[span.offset:end]

    def apply(self, fb, session_id: str) -> None:
        """Puts the recorded sampler logprobs into a decoded stable_reinforce request
        (gateway.convert.ForwardBackward), in place: one lookup for the whole request."""
        found = self._lookup(session_id, [span for datum in fb.data for span in datum.spans])
        for i, datum in enumerate(fb.data):
            if "target_tokens" not in datum.inputs:
                raise UserError(f"datum {i}: loss_fn_inputs is missing 'target_tokens'")
            targets = _dense(datum.inputs["target_tokens"]).reshape(-1)
            client = datum.inputs.get("logprobs")
            client = None if client is None else _dense(client)
            if client is not None and client.size != targets.size:
                raise UserError(f"datum {i}: logprobs has {client.size} values, target_tokens {targets.size}")
            datum.inputs["logprobs"] = self.behaviour_logprobs(session_id, i, datum.spans, targets, client, found)


def _dense(array):
    """A loss_fn_input as an array (gateway.convert.Sparse, as the SDK sent it, made dense)."""
    return array.dense() if hasattr(array, "dense") else array
