"""The gateway's gRPC clients: the trainer, and the pool of sampler replicas."""

from __future__ import annotations

from gateway.db import Database
from gateway.sampler_pool import SamplerPool
from gateway.settings import GatewaySettings
from tinkerd.rpc import ServiceAuth, aio_channel, resilient_calls
from tinkerd.v1 import trainer_pb2_grpc


class Backends:
    """Made inside the running event loop (grpc.aio channels bind to it)."""

    def __init__(self, settings: GatewaySettings, db: Database, auth: ServiceAuth):
        self.trainer = trainer_pb2_grpc.TrainerStub(aio_channel(
            settings.trainer, auth, resilient_calls("tinkerd.v1.Trainer", settings.rpc_timeout_s)))
        self.samplers = SamplerPool(settings.samplers, db, auth, timeout_s=settings.rpc_timeout_s,
                                    wait_s=settings.sampler_wait_s)

    async def close(self) -> None:
        await self.samplers.close()
