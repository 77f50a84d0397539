"""A model's weights in and out: a snapshot pushed to the samplers (save_weights_for_sampler),
save_state (adapter, with or without the optimizer), loading a saved state into a model."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
import time

from gateway import metrics, usage
from gateway.identity import audit
from gateway.jobs.base import Job, Owner, Result, json_body
from gateway.jobs.context import JobContext
from gateway.jobs.training import NewRun
from gateway.storage.db import CheckpointRow, Database, InflightTargetRow, ModelRow, SamplingSessionRow, now
from tinkerd.errors import UserError
from tinkerd.v1 import trainer_pb2

log = logging.getLogger(__name__)


def _expiry(stored: str | None) -> datetime.datetime | None:
    return datetime.datetime.fromisoformat(stored) if stored else None


async def _saved(ctx: JobContext, row: CheckpointRow, owner: Owner, key: str) -> None:
    """A checkpoint's row (written over an older one of the same path), its audit entry, its
    storage interval and its count (gateway/usage.py; once per `key`): one transaction, on the
    database's thread; the files' bytes are summed before, in a thread of their own (a walk of
    a slow disk must not hold SQLite's one thread)."""
    size = await asyncio.to_thread(usage.disk_bytes, row.directory)
    await ctx.db.run(_write_saved, ctx.db, row, owner, key, size)


def _write_saved(db: Database, row: CheckpointRow, owner: Owner, key: str, size: int | None) -> None:
    run = db.get(ModelRow, row.model_id)
    with db.session() as s:
        s.merge(row)
        s.add(audit.entry("checkpoint_saved", user_id=owner.user_id, org_id=owner.org_id, model_id=row.model_id,
                          tinker_path=row.tinker_path))
        s.flush()
        work = usage.made(s.connection(), row, run, key, size) if run is not None else None
        s.commit()
    db.forget(row)
    if run is None:
        log.warning("usage: the run of checkpoint %s is gone", row.tinker_path)
    elif work is not None:
        usage.counted(work)


@dataclasses.dataclass(frozen=True)
class PushWeights(Job):
    """save_weights_for_sampler: the snapshot goes to every live replica, then is recorded as a
    named sampler checkpoint (`path`) or as an ephemeral sampling session. An `inflight` save
    is written to disk only and becomes its model's inflight target (InflightTargetRow): it is
    done without waiting for the replicas, which load it from disk on first use."""
    kinds = ("save_weights_for_sampler",)
    message_type = trainer_pb2.PushWeightsRequest
    message: trainer_pb2.PushWeightsRequest
    caller: Owner
    session_id: str
    base_model: str
    path: str | None
    sampling_session_id: str | None
    expires_at: str | None          # ISO time, for a named checkpoint with a ttl
    inflight: bool = False

    async def run(self, ctx: JobContext) -> Result:
        push, sid = trainer_pb2.PushWeightsRequest(), self.sampling_session_id
        push.CopyFrom(self.message)
        # (In the job, not the route: a resend of this very request must still find its future. A
        # session with this very snapshot is this request's own, recorded before a re-drive.)
        existing = sid and await ctx.db.run(ctx.db.get, SamplingSessionRow, sid)
        if existing and existing.snapshot_id != push.snapshot_id:
            raise UserError(f"sampling session {sid} exists already: every "
                            f"save_weights_for_sampler needs its own sampling_session_seq_id")
        if not self.inflight:
            await ctx.samplers.refresh()      # a replica that died since the last check would stall the push
            push.sampler_addresses[:] = ctx.samplers.live_addresses()
        t0 = time.perf_counter()
        pushed = await ctx.trainer.PushWeights(push)      # a resent (model_id, seq_id) gets the first push's reply
        metrics.pushed(pushed, time.perf_counter() - t0)
        ctx.samplers.holds(push.snapshot_id, list(push.sampler_addresses), dict(pushed.transports))
        if self.inflight:
            await ctx.db.run(_publish_inflight, ctx.db, push, pushed.persisted_path)
        if self.path is not None:
            row = CheckpointRow(tinker_path=self.path, model_id=push.model_id, owner=self.caller.user_id,
                                checkpoint_type="sampler", name=self.path.rsplit("/", 1)[1],
                                snapshot_id=push.snapshot_id, snapshot_path=pushed.persisted_path,
                                directory=pushed.persisted_path, size_bytes=pushed.num_bytes,
                                expires_at=_expiry(self.expires_at), created_at=now())   # overwritten: a new generation
            await _saved(ctx, row, self.caller, f"{push.model_id}#{push.seq_id}")
        elif not existing and not await ctx.db.run(ctx.db.add_if_absent, SamplingSessionRow(
                sampling_session_id=sid, owner=self.caller.user_id, session_id=self.session_id,
                base_model=self.base_model, snapshot_id=push.snapshot_id, snapshot_path=pushed.persisted_path,
                snapshot_bytes=pushed.num_bytes, inflight_model_id=push.model_id if self.inflight else None)):
            # Another request took this sampling_session_seq_id while the weights were pushed.
            raise UserError(f"sampling session {sid} was created meanwhile by another request: every "
                            f"save_weights_for_sampler needs its own sampling_session_seq_id")
        return json_body({"path": self.path, "sampling_session_id": sid, "type": "save_weights_for_sampler"})


def _publish_inflight(db: Database, push: trainer_pb2.PushWeightsRequest, path: str) -> None:
    """The model's inflight target becomes this save's snapshot, unless a later save's is there
    already (a re-driven save must not move it back)."""
    current = db.get(InflightTargetRow, push.model_id)
    if current is None or current.seq_id < push.seq_id:
        db.put(InflightTargetRow(model_id=push.model_id, seq_id=push.seq_id, snapshot_id=push.snapshot_id,
                                 snapshot_path=path, updated_at=now()))


@dataclasses.dataclass(frozen=True)
class SaveState(Job):
    """save_weights (adapter and optimizer) or save_weights_external (adapter only)."""
    kinds = ("save_weights", "save_external_weights")
    message_type = trainer_pb2.SaveStateRequest
    message: trainer_pb2.SaveStateRequest
    caller: Owner
    path: str
    checkpoint_type: str
    expires_at: str | None
    user_metadata: dict | None
    response_type: str              # the SDK's name for the call

    def kind(self) -> str:
        return f"save_{self.message.kind}"

    async def run(self, ctx: JobContext) -> Result:
        save = self.message
        row = CheckpointRow(tinker_path=self.path, model_id=save.model_id, owner=self.caller.user_id,
                            name=save.name, checkpoint_type=self.checkpoint_type, user_metadata=self.user_metadata,
                            expires_at=_expiry(self.expires_at))
        saved = await ctx.trainer.SaveState(save)      # a resent (model_id, seq_id) gets the first save's reply
        row.directory, row.size_bytes, row.created_at = saved.directory, saved.size_bytes, now()
        await _saved(ctx, row, self.caller, f"{save.model_id}#{save.seq_id}")
        return json_body({"path": row.tinker_path, "type": self.response_type})


@dataclasses.dataclass(frozen=True)
class LoadWeights(Job):
    """A saved state into a new model (create-via-load: `new_run`) or, from older SDKs, into an
    existing one (seq_id > 0: its state is replaced)."""
    kinds = ("load_weights",)
    message_type = trainer_pb2.CreateModelRequest
    message: trainer_pb2.CreateModelRequest
    caller: Owner
    seq_id: int
    path: str
    new_run: NewRun | None

    async def run(self, ctx: JobContext) -> Result:
        if self.seq_id > 0:
            await ctx.trainer.DeleteModel(trainer_pb2.DeleteModelRequest(model_id=self.message.model_id))
        await ctx.trainer.CreateModel(self.message)
        if self.new_run is not None:
            await ctx.db.run(self.new_run.add, ctx.db, self.caller)
        return json_body({"path": self.path, "model_id": self.message.model_id, "type": "load_weights"})
