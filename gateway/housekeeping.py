"""What the gateway does on its own: unloading the models of sessions that stopped
heart-beating, releasing the models of closed sessions, expiring checkpoints and records,
deleting finished futures after --futures-retention-s and idle per-model runners."""

from __future__ import annotations

import asyncio
import datetime
import logging

import grpc
from sqlalchemy import select

from gateway.checkpoints import delete_expired_checkpoints
from gateway.db import ModelRow, now
from gateway.state import Gateway
from tinkerd.v1 import trainer_pb2

log = logging.getLogger(__name__)


async def unload_lapsed_models(gw: Gateway) -> list[str]:
    """Unloads the models of sessions that stopped heart-beating; returns their ids."""
    cutoff = now() - datetime.timedelta(seconds=gw.settings.session_timeout_s)
    unloaded = []
    for model_id in gw.db.models_of_lapsed_sessions(cutoff):
        try:
            await unload_model(gw, model_id)
        except grpc.aio.AioRpcError as e:
            log.warning("could not unload %s: %s", model_id, e.details())
            continue
        unloaded.append(model_id)
    if unloaded:
        log.info("unloaded %d models of lapsed sessions: %s", len(unloaded), unloaded)
    return unloaded


async def unload_model(gw: Gateway, model_id: str) -> None:
    """Frees the model's memory on the trainer; its next request loads it again."""
    try:
        await gw.trainer.UnloadModel(trainer_pb2.UnloadModelRequest(model_id=model_id))
    except grpc.aio.AioRpcError as e:
        if e.code() != grpc.StatusCode.NOT_FOUND:       # not loaded: nothing to free
            raise
    gw.db.touch(ModelRow, model_id, resident=False)


async def release_models(gw: Gateway, session_id: str) -> None:
    """After a session closes: once each model's queued requests have run, free it on the trainer."""
    for model_id in gw.db.select(select(ModelRow.model_id).where(ModelRow.session_id == session_id)):
        await gw.futures.drained(model_id)
        try:
            await gw.trainer.DeleteModel(trainer_pb2.DeleteModelRequest(model_id=model_id))
        except grpc.aio.AioRpcError as e:
            log.warning("could not release %s: %s", model_id, e.details())
            continue
        gw.futures.forget_runner(model_id)       # the trainer deleted its durable state
        gw.db.touch(ModelRow, model_id, resident=False)
    log.info("session %s closed; its models are released", session_id)


def prune_futures(gw: Gateway) -> int:
    """Deletes futures finished more than --futures-retention-s ago (a later retrieve of one is
    a 404, as for an unknown id) and forgets idle models' runners; returns the rows deleted."""
    deleted = gw.db.delete_finished_futures(now() - datetime.timedelta(seconds=gw.settings.futures_retention_s))
    if deleted:
        log.info("deleted %d futures finished over %.0f s ago", deleted, gw.settings.futures_retention_s)
    gw.futures.drop_idle_runners()
    return deleted


async def run_forever(gw: Gateway) -> None:
    interval = min(max(gw.settings.session_timeout_s / 4, 0.5), 30.0)
    while True:
        await asyncio.sleep(interval)
        try:
            await unload_lapsed_models(gw)
            delete_expired_checkpoints(gw.db)
            gw.stability.expire()
            prune_futures(gw)
        except Exception:  # noqa: BLE001 - housekeeping must outlive one bad pass
            log.exception("housekeeping failed")
