"""Which sessions, models, sampling sessions and checkpoints a caller may use now: every lookup
by an id or path the client sent goes through here, awaited: a row not in the row cache is read
on the database's threads (Database.row), never on the event loop.

Rows belong to the user who made them. Another user's id gets the same 404 as an id that does
not exist, so nobody learns what others have; a published checkpoint can be read (loaded,
sampled, inspected) by every user, and changed only by its owner. Closed sessions are refused.

A sampling session over an ephemeral snapshot is deleted once unused long enough
(gateway/housekeeping.py prune_snapshots); asample records its use here, in its row.
"""

from __future__ import annotations

from gateway.identity.caller import Caller
from gateway.settings import GatewaySettings
from gateway.storage.db import (CheckpointRow, Database, InflightTargetRow, ModelRow, SamplingSessionRow, SessionRow,
                                aware, now)
from tinkerd.errors import NotFoundError, UserError


def mine(caller: Caller, row) -> bool:
    return row is not None and row.owner == caller.user_id


# A sampling session's last_used is written at most this often (by any gateway: the row says
# when it was last written), so the sampling hot path does not write a row per sample.
LAST_USED_RESOLUTION_S = 60.0


class Sessions:
    def __init__(self, db: Database, settings: GatewaySettings):
        self.db = db
        self.settings = settings

    async def closed(self, session_id: str) -> bool:
        """Whether the session was closed (ServiceClient.close), on any gateway: read from its row,
        through the row cache, so a close elsewhere is seen within db.CACHE_TTL_S (2 s). A session
        whose row is gone was closed and pruned (housekeeping.prune_sessions)."""
        row = await self.db.row(SessionRow, session_id)
        return row is None or bool(row.finished)

    async def _owned(self, caller: Caller, cls, key: str, unknown: str):
        """The caller's row of `cls`; anyone else's is as unknown as a missing one."""
        row = await self.db.row(cls, key)
        if not mine(caller, row):
            raise NotFoundError(unknown)
        return row

    async def session(self, caller: Caller, session_id: str) -> SessionRow:
        return await self._owned(caller, SessionRow, session_id, f"unknown session_id {session_id!r}")

    async def open(self, caller: Caller, session_id: str) -> str:
        """A session of the caller's that is not closed."""
        if (await self.session(caller, session_id)).finished:
            raise UserError(f"session {session_id} was closed (ServiceClient.close); start a new ServiceClient")
        return session_id

    async def model(self, caller: Caller, model_id: str) -> ModelRow:
        return await self._owned(caller, ModelRow, model_id,
                           f"unknown model_id {model_id!r}: create it with create_model first")

    async def live_model(self, caller: Caller, model_id: str) -> ModelRow:
        """A model that can still be trained: the caller's, and its session not closed."""
        row = await self.model(caller, model_id)
        if await self.closed(row.session_id):
            raise UserError(f"model {model_id} belongs to session {row.session_id}, which was closed "
                            f"(ServiceClient.close); its checkpoints can still be loaded in a new session")
        return row

    async def sampling_session(self, caller: Caller, sampling_session_id: str) -> SamplingSessionRow:
        row = await self.db.row(SamplingSessionRow, sampling_session_id)
        if mine(caller, row):
            return row
        session_id, sep, _ = sampling_session_id.rpartition(":sample:")
        if sep and mine(caller, await self.db.row(SessionRow, session_id)):
            # One of the caller's sessions: most likely an ephemeral one that was pruned.
            raise NotFoundError(
                f"sampling session {sampling_session_id} expired or never existed: a sampling session of "
                f"save_weights_and_get_sampling_client is deleted once unused for "
                f"{self.settings.snapshot_retention_s:.0f} s after its session closed or stopped heart-beating; "
                f"call save_weights_and_get_sampling_client again")
        raise NotFoundError(f"unknown sampling_session_id {sampling_session_id!r}")

    async def used(self, row: SamplingSessionRow) -> None:
        """Records that the sampling session sampled (its snapshot is kept while in use)."""
        resolution = min(LAST_USED_RESOLUTION_S, self.settings.snapshot_retention_s / 4)
        last = row.last_used or row.created_at
        if last is None or (now() - aware(last)).total_seconds() > resolution:
            await self.db.run(self.db.touch, SamplingSessionRow, row.sampling_session_id, last_used=now())

    async def live_sampling_session(self, caller: Caller, sampling_session_id: str) -> SamplingSessionRow:
        """One that can sample now: its session open and, if made from a checkpoint's path, that
        checkpoint still readable by the caller and still these weights. Unpublishing or
        deleting a checkpoint cuts off the sampling sessions others made from it within
        db.CACHE_TTL_S (2 s: the checkpoint row is read through the row cache)."""
        row = await self.sampling_session(caller, sampling_session_id)
        if await self.closed(row.session_id):
            raise UserError(f"sampling session {sampling_session_id} belongs to session {row.session_id}, "
                            f"which was closed (ServiceClient.close)")
        if row.model_path:
            ckpt = await self.db.row(CheckpointRow, row.model_path)
            if ckpt is None or not (mine(caller, ckpt) or ckpt.public) or ckpt.snapshot_id != row.snapshot_id:
                raise NotFoundError(f"sampling session {sampling_session_id} samples {row.model_path!r}, which "
                                    f"was deleted, replaced or unpublished since; its weights can no longer be "
                                    f"sampled")
        return row

    async def weights(self, row: SamplingSessionRow) -> tuple[str, str, str]:
        """What a sampling session samples now: (snapshot id, its path, prefix-cache namespace).
        A snapshot client: its own snapshot, cache shared. An inflight one: its model's newest
        inflight save (read uncached, on the database's threads: it only moves forward, so the
        client never gets weights older than it was made with), in a cache namespace of its own."""
        if row.inflight_model_id is None:
            return row.snapshot_id, row.snapshot_path, ""
        target = await self.db.row(InflightTargetRow, row.inflight_model_id)
        if target is None:
            return row.snapshot_id, row.snapshot_path, row.sampling_session_id
        return target.snapshot_id, target.snapshot_path, row.sampling_session_id

    async def checkpoint(self, caller: Caller, run_id: str, checkpoint_id: str, *, change: bool) -> CheckpointRow:
        """A checkpoint of the run the caller may read (theirs or published) or, with `change`,
        that is theirs."""
        row = await self.db.row(CheckpointRow, f"tinker://{run_id}/{checkpoint_id}")
        if row is None or row.model_id != run_id or not (mine(caller, row) or (row.public and not change)):
            raise NotFoundError(f"run {run_id!r} has no checkpoint {checkpoint_id!r}")
        return row

    async def readable_checkpoint(self, caller: Caller, tinker_path: str) -> CheckpointRow:
        """The caller's checkpoint, or a published one."""
        row = await self.db.row(CheckpointRow, tinker_path)
        if row is None or not (mine(caller, row) or row.public):
            raise NotFoundError(f"unknown checkpoint {tinker_path!r}")
        return row

    async def close(self, caller: Caller, session_id: str, reason: str | None = None, detail: str | None = None) -> bool:
        """Marks the caller's session closed, with the reason its client gave; False if it already was."""
        await self.session(caller, session_id)
        return await self.db.run(self.db.close_session, session_id, reason, detail)
