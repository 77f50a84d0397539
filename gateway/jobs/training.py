"""A training run's jobs: create_model, forward / forward_backward, optim_step. They run in the
model's seq_id order (gateway/futures/order.py)."""

from __future__ import annotations

import dataclasses

from gateway import convert, metrics, step_metrics, usage
from gateway.identity import audit
from gateway.jobs.base import Done, Job, Owner, Result, json_body
from gateway.jobs.context import JobContext
from gateway.jobs.refused import Refused  # noqa: F401 - a model's request its route refused, in its order
from gateway.storage.db import Database, ModelRow
from gateway.traces import spans
from tinkerd.optimizers import ADAMW
from tinkerd.v1 import trainer_pb2


@dataclasses.dataclass(frozen=True)
class NewRun:
    """A training run's row, written once the trainer holds its model (a failed create leaves none)."""
    model_id: str
    session_id: str
    owner: str
    base_model: str
    lora_rank: int
    lora_config: dict
    optimizer: str = ADAMW          # fixed for the run's life

    def add(self, db: Database, owner: Owner) -> None:
        if db.get(ModelRow, self.model_id) is None:
            db.add(ModelRow(**dataclasses.asdict(self)))
            audit.record(db, "training_run_created", user_id=owner.user_id, org_id=owner.org_id,
                         model_id=self.model_id, base_model=self.base_model, lora_rank=self.lora_rank)


@dataclasses.dataclass(frozen=True)
class CreateModel(Job):
    kinds = ("create_model",)
    message_type = trainer_pb2.CreateModelRequest
    message: trainer_pb2.CreateModelRequest
    caller: Owner
    new_run: NewRun

    async def run(self, ctx: JobContext) -> Result:
        await ctx.trainer.CreateModel(self.message)
        await ctx.db.run(self.new_run.add, ctx.db, self.caller)
        return json_body({"model_id": self.message.model_id, "type": "create_model"})


@dataclasses.dataclass(frozen=True)
class ForwardBackward(Job):
    """forward_backward, or forward (forward_only): the SDK's request, translated once at the route."""
    kinds = ("forward_backward", "forward")
    message_type = trainer_pb2.ForwardBackwardRequest
    message: trainer_pb2.ForwardBackwardRequest

    def kind(self) -> str:
        return "forward" if self.message.forward_only else "forward_backward"

    async def run(self, ctx: JobContext) -> Result:
        reply = await ctx.trainer.ForwardBackward(self.message)
        metrics.trained(self.message)
        spans.note(tokens_in=sum(len(d.tokens) for d in self.message.data))
        return Done("application/x-protobuf", convert.forward_backward_output(reply), usage.trained(self.message),
                    step_metrics.recorder(self.message, reply))


@dataclasses.dataclass(frozen=True)
class OptimStep(Job):
    kinds = ("optim_step",)
    message_type = trainer_pb2.OptimStepRequest
    message: trainer_pb2.OptimStepRequest

    async def run(self, ctx: JobContext) -> Result:
        reply = await ctx.trainer.OptimStep(self.message)
        return Done(*json_body({"metrics": dict(reply.metrics), "type": "optim_step"}),
                    records=step_metrics.recorder(self.message, reply))
