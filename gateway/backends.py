"""The gateway's gRPC clients: the trainer, and the pool of sampler replicas."""

from __future__ import annotations

import asyncio
import logging

import grpc

from gateway.sampler_pool import SamplerPool
from gateway.settings import GatewaySettings
from gateway.storage.db import Database
from gateway.tenant import TENANT
from tinkerd.rpc import (TENANT_METADATA, AioCallsWithMetadata, ServiceAuth, aio_channel, resilient_calls,
                         user_tenant)
from tinkerd.v1 import common_pb2, trainer_pb2_grpc

log = logging.getLogger(__name__)


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
        self._token_check = asyncio.create_task(self._check_token(settings.trainer)) if auth.holds_token else None

    async def _check_token(self, address: str) -> None:
        """Says at start, once the trainer answers, when it refuses this gateway's token (every
        training call would fail; /healthz then shows the trainer down)."""
        try:
            await self.trainer.Health(common_pb2.HealthRequest())
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                log.error("%s", token_mismatch(address, e.details()))

    async def close(self) -> None:
        if self._token_check:
            self._token_check.cancel()
        await self.samplers.close()


def token_mismatch(address: str, details: str) -> str:
    return (f"service token mismatch with the trainer at {address}: it refuses this gateway's token "
            f"({details}); give the gateway and the trainer the same service secret (--service-token-file), "
            f"or credentials made from it")
