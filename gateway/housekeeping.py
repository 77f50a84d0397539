"""What the gateway does on its own: unloading the models of sessions that stopped
heart-beating, releasing the models of closed sessions, expiring checkpoints and records,
deleting finished futures after --futures-retention-s and idle per-model runners, and pruning
ephemeral sampler snapshots nobody can reach any more.

Every pass (each session_timeout_s / 4, between 0.5 and 30 s), on every gateway (each step is
safe to run on several at once; its deletions in a thread, off the event loop):
- futures finished more than --futures-retention-s ago are deleted (a later retrieve is a 404);
- an ephemeral snapshot (save_weights_and_get_sampling_client: a persisted copy under
  <state_dir>/snapshots/, reachable only through the sampling sessions made for it) is deleted,
  its files and every sampling session that points at it, once none of those sampling sessions
  sampled (asample) or was made within --snapshot-retention-s, and each of their sessions is
  closed or has not heart-beaten within --session-timeout-s; so is one of a model that has a newer
  ephemeral snapshot once none of its sampling sessions sampled within
  --superseded-snapshot-retention-s (1 h), live session or not: an RL loop makes one per step and
  samples only the newest, so without this a day-long loop would keep every step's adapter on
  disk. A model's newest snapshot waits for the first rule. A later asample or get_sampler on
  one of them is a 404 that says to call save_weights_and_get_sampling_client again. Named
  sampler checkpoints (save_weights_for_sampler with a path) are never pruned here: they go by
  their ttl or when deleted;
- a session closed more than --closed-session-retention-s ago whose runs hold no checkpoint is
  deleted with its runs (and their step metrics) and sampling sessions, so closed sessions do
  not pile up in the database (the open ones are capped by --max-sessions-per-user). A later
  call naming it is a 404; its ephemeral snapshots are pruned as unreachable by the rule above.
"""

from __future__ import annotations

import asyncio
import datetime
import typing
import logging
import os
import shutil

import grpc
from sqlalchemy import select

from gateway import custom_losses, usage
from gateway.checkpoints import delete_expired_checkpoints
from gateway.jobs.service import unload_model
from gateway.storage.db import ModelRow, now
from gateway.traces import spans
from tinkerd import paths, persisted_copy
from tinkerd.errors import UserError
from tinkerd.v1 import trainer_pb2

if typing.TYPE_CHECKING:       # the container (gateway/state.py) holds what these tasks run over
    from gateway.state import Gateway

log = logging.getLogger(__name__)


async def unload_lapsed_models(gw: Gateway) -> list[str]:
    """Unloads the models of sessions that stopped heart-beating; returns their ids."""
    cutoff = now() - datetime.timedelta(seconds=gw.settings.session_timeout_s)
    unloaded = []
    for model_id in await gw.db.run(gw.db.models_of_lapsed_sessions, cutoff):
        try:
            await unload_model(gw.trainer, gw.db, model_id)
        except grpc.aio.AioRpcError as e:
            log.warning("could not unload %s: %s", model_id, e.details())
            continue
        unloaded.append(model_id)
    if unloaded:
        log.info("unloaded %d models of lapsed sessions: %s", len(unloaded), unloaded)
    return unloaded


async def release_models(gw: Gateway, session_id: str) -> None:
    """After a session closes: once each model's queued requests have run, free it on the trainer."""
    for model_id in await gw.db.run(gw.db.select, select(ModelRow.model_id).where(ModelRow.session_id == session_id)):
        await gw.futures.drained(model_id)
        try:
            await gw.trainer.DeleteModel(trainer_pb2.DeleteModelRequest(model_id=model_id))
        except grpc.aio.AioRpcError as e:
            log.warning("could not release %s: %s", model_id, e.details())
            continue
        gw.jobs.order.forget(model_id)       # the trainer deleted its durable state
        await gw.db.run(gw.db.touch, ModelRow, model_id, resident=False)
    await gw.db.run(custom_losses.forget_session, gw.db, session_id)      # its models' requests have run
    log.info("session %s closed; its models are released", session_id)


def prune_futures(gw: Gateway) -> int:
    """Deletes futures finished more than --futures-retention-s ago (a later retrieve of one is
    a 404, as for an unknown id) and request spans older than --trace-retention-s; returns the
    futures deleted."""
    deleted = gw.futures.store.delete_finished(now() - datetime.timedelta(seconds=gw.settings.futures_retention_s))
    if deleted:
        log.info("deleted %d futures finished over %.0f s ago", deleted, gw.settings.futures_retention_s)
    gw.traces.delete_before(spans.now_us() - int(gw.settings.trace_retention_s * 1e6))
    return deleted


def prune_sessions(gw: Gateway) -> int:
    """Deletes the sessions closed over --closed-session-retention-s ago that hold no checkpoint
    (this module's docstring); returns how many."""
    pruned = gw.db.prune_closed_sessions(now() - datetime.timedelta(seconds=gw.settings.closed_session_retention_s))
    if pruned:
        log.info("pruned %d sessions closed over %.0f s ago", len(pruned), gw.settings.closed_session_retention_s)
    return len(pruned)


def prune_snapshots(gw: Gateway) -> int:
    """Deletes the ephemeral snapshots nobody can reach any more (the rule is in this module's
    docstring): files first, then the sampling sessions, so a pass cut short is finished by the
    next one. Returns the snapshots deleted."""
    stamp = now()
    prunable = gw.db.prunable_snapshots(
        unused_before=stamp - datetime.timedelta(seconds=gw.settings.snapshot_retention_s),
        lapsed_before=stamp - datetime.timedelta(seconds=gw.settings.session_timeout_s),
        superseded_unused_before=stamp - datetime.timedelta(seconds=gw.settings.superseded_snapshot_retention_s))
    for snapshot_id, (recorded_path, sampling_session_ids) in prunable.items():
        delete_snapshot_files(gw.settings.state_dir, snapshot_id, recorded_path)
        gw.db.delete_sampling_sessions(sampling_session_ids)
        log.info("pruned snapshot %s, unused for over %.0f s (sampling sessions %s)", snapshot_id,
                 gw.settings.snapshot_retention_s, sampling_session_ids)
    return len(prunable)


def delete_snapshot_files(state_dir: str, snapshot_id: str, recorded_path: str) -> None:
    """The snapshot's directory (and a failed copy's marker) below <state_dir>/snapshots/ and
    nowhere else: derived from its id here, and the recorded path only if it lies there too.
    Files already gone are fine."""
    root = os.path.join(state_dir, paths.SNAPSHOTS)
    targets = set()
    try:
        targets.add(paths.snapshot_dir(state_dir, snapshot_id))
    except UserError:           # a link there that resolves outside snapshots/: not ours to delete
        log.warning("snapshot %s: its directory resolves outside %s; left alone", snapshot_id, root)
    if recorded_path:
        try:
            targets.add(paths.contained(root, recorded_path))
        except UserError:
            log.warning("snapshot %s records %r, outside %s; left alone", snapshot_id, recorded_path, root)
    for path in targets:
        if os.path.islink(path):        # never follow a link out of snapshots/
            os.unlink(path)
            continue
        shutil.rmtree(path, ignore_errors=True)
        try:
            os.remove(persisted_copy.failed_marker(path))
        except FileNotFoundError:
            pass


def _prune(gw: Gateway) -> None:
    """A pass of deletions, in a thread of its own: big deletes and snapshot directories' removal
    never hold up the event loop."""
    delete_expired_checkpoints(gw.db)
    gw.stability.expire()
    prune_futures(gw)
    usage.reconcile(gw.db, now() - datetime.timedelta(seconds=gw.settings.futures_retention_s))
    prune_sessions(gw)
    prune_snapshots(gw)


async def one_pass(gw: Gateway) -> None:
    await unload_lapsed_models(gw)
    await asyncio.to_thread(_prune, gw)
    gw.jobs.order.drop_idle()           # the loop's own state


async def run_forever(gw: Gateway) -> None:
    interval = min(max(gw.settings.session_timeout_s / 4, 0.5), 30.0)
    while True:
        await asyncio.sleep(interval)
        try:
            await one_pass(gw)
        except Exception:  # noqa: BLE001 - housekeeping must outlive one bad pass
            log.exception("housekeeping failed")
