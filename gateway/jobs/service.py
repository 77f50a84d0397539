"""Jobs that send no request of their own: unload_model (SDK <= 0.25) and the benchmarks' noop."""

from __future__ import annotations

import dataclasses

from gateway import housekeeping
from gateway.jobs.base import Job, Result, json_body
from tinkerd.v1 import common_pb2


@dataclasses.dataclass(frozen=True)
class UnloadModel(Job):
    """Once the model's queued requests have run, its memory on the trainer is freed."""
    kinds = ("unload_model",)
    model_id: str

    async def run(self, gw) -> Result:
        await gw.futures.drained(self.model_id)     # this future has no model_id: it does not wait for itself
        await housekeeping.unload_model(gw, self.model_id)
        return json_body({"model_id": self.model_id, "type": "unload_model"})


@dataclasses.dataclass(frozen=True)
class Noop(Job):
    """One trainer Health call (bench/futures.py measures the futures path with it)."""
    kinds = ("noop",)

    async def run(self, gw) -> Result:
        await gw.trainer.Health(common_pb2.HealthRequest())
        return json_body({"type": "noop"})
