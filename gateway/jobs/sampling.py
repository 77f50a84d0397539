"""A sample: one SampleRequest to the sampler pool."""

from __future__ import annotations

import dataclasses

from gateway import convert, metrics, usage
from gateway.jobs.base import Done, Job, Result
from gateway.jobs.context import JobContext
from gateway.traces import spans
from tinkerd.v1 import sampler_pb2


@dataclasses.dataclass(frozen=True)
class SampleOf:
    """Whose a sample is, known when it is submitted: its usage needs no lookup when it finishes."""
    owner: str
    session_id: str          # "" for an OpenAI request (no sampling session)
    base_model: str


@dataclasses.dataclass(frozen=True)
class Sample(Job):
    """Re-driven, a sample is simply sampled again: its first result was never delivered."""
    kinds = ("sample",)
    message_type = sampler_pb2.SampleRequest
    message: sampler_pb2.SampleRequest
    record_for: str | None = None       # the session whose stable_reinforce steps may name these sequences
    of: SampleOf | None = None          # whose (None in rows of older gateways: looked up)

    async def run(self, ctx: JobContext) -> Result:
        reply = await ctx.samplers.sample(self.message)
        metrics.sampled(reply)
        if self.of is None:
            await usage.sampled(ctx.db, ctx.served_model, self.message, reply)
        prompt, sampled = len(self.message.prompt_tokens), sum(len(s.tokens) for s in reply.sequences)
        spans.note(tokens_in=prompt, tokens_out=sampled)
        if self.record_for is not None:
            await ctx.db.run(ctx.stability.record_all, self.record_for,
                             {f"{self.message.request_id}:{i}": (seq.tokens, seq.logprobs)
                              for i, seq in enumerate(reply.sequences)})
        work = None if self.of is None else usage.sample_work(
            self.message.request_id, prompt, sampled, self.of.owner, self.of.session_id, self.of.base_model)
        return Done("application/x-protobuf", convert.sample_response(reply), work)
