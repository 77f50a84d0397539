"""What a job runs with: the parts of the gateway its `run` reaches, and nothing else.

Built once at startup, when the backends exist (gateway/app.py hands it to the job engine,
gateway/jobs/engine.py, which hands it to every job's `run`). Jobs hold no reference to the
gateway's container (gateway/state.py), so they cannot reach what they are not given.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Awaitable, Callable, Coroutine

if typing.TYPE_CHECKING:         # types only: the jobs sit below these parts in the import graph
    from gateway.sampler_pool import SamplerPool
    from gateway.stability import StabilityRecords
    from gateway.storage.db import Database
    from tinkerd.rpc import AioCallsWithMetadata


@dataclasses.dataclass(frozen=True)
class JobContext:
    trainer: "AioCallsWithMetadata"     # the trainer's stub: each call carries the service token and the tenant
    samplers: "SamplerPool"             # the sampler replicas (samples, and where pushed weights go)
    db: "Database"
    stability: "StabilityRecords"       # the sampled sequences a session's stable_reinforce steps may name
    drained: Callable[[str], Awaitable[None]]    # returns once a model's futures scheduled so far have finished
    served_model: str                   # the base model served here: an OpenAI sample's usage counts under it
    in_background: Callable[[Coroutine], None]      # runs a coroutine to its end, held (gateway/state.py)
