"""Which sessions, models, sampling sessions and checkpoints a caller may use now: every lookup
by an id or path the client sent goes through here.

Rows belong to the user who made them. Another user's id gets the same 404 as an id that does
not exist, so nobody learns what others have; a published checkpoint can be read (loaded,
sampled, inspected) by every user, and changed only by its owner. Closed sessions are refused.
"""

from __future__ import annotations

from sqlalchemy import select

from gateway.db import CheckpointRow, Database, ModelRow, SamplingSessionRow, SessionRow
from gateway.keys import Caller
from tinkerd.errors import NotFoundError, UserError


def mine(caller: Caller, row) -> bool:
    return row is not None and row.owner == caller.user_id


class Sessions:
    def __init__(self, db: Database):
        self.db = db
        # Closed by the client (ServiceClient.close): read on every training and sampling
        # request, so kept in memory.
        self.closed = set(db.select(select(SessionRow.session_id).where(SessionRow.finished.is_(True))))

    def _owned(self, caller: Caller, cls, key: str, unknown: str):
        """The caller's row of `cls`; anyone else's is as unknown as a missing one."""
        row = self.db.get(cls, key)
        if not mine(caller, row):
            raise NotFoundError(unknown)
        return row

    def session(self, caller: Caller, session_id: str) -> SessionRow:
        return self._owned(caller, SessionRow, session_id, f"unknown session_id {session_id!r}")

    def open(self, caller: Caller, session_id: str) -> str:
        """A session of the caller's that is not closed."""
        self.session(caller, session_id)
        if session_id in self.closed:
            raise UserError(f"session {session_id} was closed (ServiceClient.close); start a new ServiceClient")
        return session_id

    def model(self, caller: Caller, model_id: str) -> ModelRow:
        return self._owned(caller, ModelRow, model_id,
                           f"unknown model_id {model_id!r}: create it with create_model first")

    def live_model(self, caller: Caller, model_id: str) -> ModelRow:
        """A model that can still be trained: the caller's, and its session not closed."""
        row = self.model(caller, model_id)
        if row.session_id in self.closed:
            raise UserError(f"model {model_id} belongs to session {row.session_id}, which was closed "
                            f"(ServiceClient.close); its checkpoints can still be loaded in a new session")
        return row

    def sampling_session(self, caller: Caller, sampling_session_id: str) -> SamplingSessionRow:
        return self._owned(caller, SamplingSessionRow, sampling_session_id,
                           f"unknown sampling_session_id {sampling_session_id!r}")

    def live_sampling_session(self, caller: Caller, sampling_session_id: str) -> SamplingSessionRow:
        row = self.sampling_session(caller, sampling_session_id)
        if row.session_id in self.closed:
            raise UserError(f"sampling session {sampling_session_id} belongs to session {row.session_id}, "
                            f"which was closed (ServiceClient.close)")
        return row

    def readable_checkpoint(self, caller: Caller, tinker_path: str) -> CheckpointRow:
        """The caller's checkpoint, or a published one."""
        row = self.db.get(CheckpointRow, tinker_path)
        if row is None or not (mine(caller, row) or row.public):
            raise NotFoundError(f"unknown checkpoint {tinker_path!r}")
        return row

    def close(self, caller: Caller, session_id: str) -> bool:
        """Marks the caller's session closed; False if it already was."""
        self.session(caller, session_id)
        if session_id in self.closed:
            return False
        self.db.touch(SessionRow, session_id, finished=True)
        self.closed.add(session_id)
        return True
