"""The gateway's gRPC clients: one trainer, and sampler replicas taken in turn."""

from __future__ import annotations

import itertools

from gateway.settings import GatewaySettings
from tinkerd.rpc import ServiceAuth, aio_channel, resilient_calls
from tinkerd.v1 import sampler_pb2_grpc, trainer_pb2_grpc


class Backends:
    """Made inside the running event loop (grpc.aio channels bind to it)."""

    def __init__(self, settings: GatewaySettings):
        auth = ServiceAuth.of(settings)
        self.trainer = trainer_pb2_grpc.TrainerStub(aio_channel(
            settings.trainer, auth, resilient_calls("tinkerd.v1.Trainer", settings.rpc_timeout_s)))
        sampler_calls = resilient_calls("tinkerd.v1.Sampler", settings.rpc_timeout_s)
        self.samplers = [sampler_pb2_grpc.SamplerStub(aio_channel(a, auth, sampler_calls)) for a in settings.samplers]
        self._next = itertools.cycle(range(len(self.samplers)))

    def sampler(self) -> sampler_pb2_grpc.SamplerStub:
        return self.samplers[next(self._next)]
