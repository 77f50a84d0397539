"""The gateway's gRPC clients: the trainer, and the pool of sampler replicas."""

from __future__ import annotations

from gateway.sampler_pool import SamplerPool
from gateway.settings import GatewaySettings
from gateway.storage.db import Database
from gateway.tenant import TENANT
from tinkerd.rpc import (TENANT_METADATA, AioCallsWithMetadata, ServiceAuth, aio_channel, resilient_calls,
                         user_tenant)
from tinkerd.v1 import trainer_pb2_grpc



def _tenant() -> tuple[tuple[str, str], ...]:
    user = TENANT.get()
    return ((TENANT_METADATA, user_tenant(user)),) if user else ()


class Backends:
    """Made inside the running event loop (grpc.aio channels bind to it)."""

    def __init__(self, settings: GatewaySettings, db: Database, auth: ServiceAuth):
        channel = aio_channel(settings.trainer, auth, resilient_calls("tinkerd.v1.Trainer", settings.rpc_timeout_s),
                              send_token=False)
        self.trainer = AioCallsWithMetadata(trainer_pb2_grpc.TrainerStub(channel), auth.bearer("trainer"), _tenant)
        self.samplers = SamplerPool(settings.samplers, db, auth, timeout_s=settings.rpc_timeout_s,
                                    wait_s=settings.sampler_wait_s)

    async def close(self) -> None:
        await self.samplers.close()
