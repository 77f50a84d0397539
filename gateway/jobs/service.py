"""Jobs that send no request of their own: unload_model (SDK <= 0.25) and the benchmarks' noop."""

from __future__ import annotations

import dataclasses
import typing

import grpc

from gateway.jobs.base import Job, Result, json_body
from gateway.jobs.context import JobContext
from gateway.storage.db import Database, ModelRow
from tinkerd.v1 import common_pb2, trainer_pb2

if typing.TYPE_CHECKING:
    from tinkerd.rpc import AioCallsWithMetadata


@dataclasses.dataclass(frozen=True)
class UnloadModel(Job):
    """Once the model's queued requests have run, its memory on the trainer is freed."""
    kinds = ("unload_model",)
    model_id: str

    async def run(self, ctx: JobContext) -> Result:
        await ctx.drained(self.model_id)     # this future has no model_id: it does not wait for itself
        await unload_model(ctx.trainer, ctx.db, self.model_id)
        return json_body({"model_id": self.model_id, "type": "unload_model"})


async def unload_model(trainer: "AioCallsWithMetadata", db: Database, model_id: str) -> None:
    """Frees the model's memory on the trainer; its next request loads it again (also what
    housekeeping does to a lapsed session's models)."""
    try:
        await trainer.UnloadModel(trainer_pb2.UnloadModelRequest(model_id=model_id))
    except grpc.aio.AioRpcError as e:
        if e.code() != grpc.StatusCode.NOT_FOUND:       # not loaded: nothing to free
            raise
    await db.run(db.touch, ModelRow, model_id, resident=False)


@dataclasses.dataclass(frozen=True)
class Noop(Job):
    """One trainer Health call (bench/futures.py measures the futures path with it)."""
    kinds = ("noop",)

    async def run(self, ctx: JobContext) -> Result:
        await ctx.trainer.Health(common_pb2.HealthRequest())
        return json_body({"type": "noop"})
