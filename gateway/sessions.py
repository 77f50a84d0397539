"""Which sessions, models and sampling sessions a request may use now: every lookup by an id
the client sent goes through here, and refuses unknown ids and closed sessions alike."""

from __future__ import annotations

from sqlalchemy import select

from gateway.db import Database, ModelRow, SamplingSessionRow, SessionRow
from tinkerd.errors import NotFoundError, UserError


class Sessions:
    def __init__(self, db: Database):
        self.db = db
        # Closed by the client (ServiceClient.close): read on every training and sampling
        # request, so kept in memory.
        self.closed = set(db.select(select(SessionRow.session_id).where(SessionRow.finished.is_(True))))

    def open(self, session_id: str) -> str:
        """A session that exists and is not closed."""
        if self.db.get(SessionRow, session_id) is None:
            raise UserError(f"unknown session_id {session_id!r}")
        if session_id in self.closed:
            raise UserError(f"session {session_id} was closed (ServiceClient.close); start a new ServiceClient")
        return session_id

    def model(self, model_id: str) -> ModelRow:
        row = self.db.get(ModelRow, model_id)
        if row is None:
            raise UserError(f"unknown model_id {model_id!r}: create it with create_model first")
        return row

    def live_model(self, model_id: str) -> ModelRow:
        """A model that can still be trained: known, and its session not closed."""
        row = self.model(model_id)
        if row.session_id in self.closed:
            raise UserError(f"model {model_id} belongs to session {row.session_id}, which was closed "
                            f"(ServiceClient.close); its checkpoints can still be loaded in a new session")
        return row

    def live_sampling_session(self, sampling_session_id: str) -> SamplingSessionRow:
        row = self.db.get(SamplingSessionRow, sampling_session_id)
        if row is None:
            raise UserError(f"unknown sampling_session_id {sampling_session_id!r}")
        if row.session_id in self.closed:
            raise UserError(f"sampling session {sampling_session_id} belongs to session {row.session_id}, "
                            f"which was closed (ServiceClient.close)")
        return row

    def close(self, session_id: str) -> bool:
        """Marks the session closed; False if it already was."""
        if session_id in self.closed:
            return False
        if not self.db.touch(SessionRow, session_id, finished=True):
            raise NotFoundError(f"unknown session {session_id!r}")
        self.closed.add(session_id)
        return True
