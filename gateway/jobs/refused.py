"""A model's request its route refused: it still takes its seq_id's turn (gateway/jobs/engine.py
Jobs.refuse)."""

from __future__ import annotations

import dataclasses

from gateway.jobs.base import Job, Result
from gateway.jobs.context import JobContext
from tinkerd.errors import UserError
from tinkerd.v1 import trainer_pb2


@dataclasses.dataclass(frozen=True)
class Refused(Job):
    """A model's request the gateway refused (bad input, a 400 to the client): its seq_id still
    takes its turn, so the model's next request waits for nobody (neither this gateway's runner
    nor the trainer's order waits out its gap timeout). The future fails with the same error."""
    kinds = ("refused",)
    model_id: str
    seq_id: int
    error: str

    async def run(self, ctx: JobContext) -> Result:
        await ctx.trainer.SkipSeq(trainer_pb2.SkipSeqRequest(model_id=self.model_id, seq_id=self.seq_id))
        raise UserError(self.error)
