"""The gateway on in-process fake Trainer and Sampler gRPC services (real grpc servers on port 0),
driven over HTTP in-process (fastapi's TestClient): route logic tested in milliseconds. The fakes
record every request and answer with simple, predictable values; the real services are tested
end to end in tests/e2e. Test modules import the `gateway` fixture from here."""

from __future__ import annotations

import contextlib
import os
import types

import grpc
import numpy as np
import pytest
from fastapi.testclient import TestClient

from gateway.app import create_app
from gateway.identity import keys
from gateway.settings import GatewaySettings
from tinkerd import paths
from tinkerd.health import ServiceHealth
from tinkerd.rpc import create_server
from tinkerd.tensors import from_numpy
from tinkerd.v1 import common_pb2, sampler_pb2, sampler_pb2_grpc, trainer_pb2, trainer_pb2_grpc


class FakeTrainer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, state_dir: str):
        self.state_dir = state_dir     # where it derives directories, as the real trainer does
        self.requests: list[tuple[str, object]] = []

    def _got(self, name, request):
        self.requests.append((name, request))

    def of(self, name: str) -> list:
        return [r for n, r in self.requests if n == name]

    def Health(self, request, context):
        return common_pb2.HealthResponse(ready=True)

    def CreateModel(self, request, context):
        self._got("CreateModel", request)
        if request.lora_config.rank > 64:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "LoRA rank must be in 1..64")
        return trainer_pb2.ModelInfo(model_id=request.model_id)

    def DeleteModel(self, request, context):
        self._got("DeleteModel", request)
        return trainer_pb2.DeleteModelResponse(deleted=True)

    def ForwardBackward(self, request, context):
        """logprobs = -token ids / 100, one per input position."""
        self._got("ForwardBackward", request)
        outputs = [trainer_pb2.DatumOutput(outputs={"logprobs": from_numpy(-np.asarray(d.tokens, np.float32) / 100)})
                   for d in request.data]
        return trainer_pb2.ForwardBackwardResponse(outputs=outputs, metrics={"loss:sum": 1.5})

    def OptimStep(self, request, context):
        self._got("OptimStep", request)
        return trainer_pb2.OptimStepResponse(metrics={"step:max": float(len(self.of("OptimStep")))})

    def PushWeights(self, request, context):
        self._got("PushWeights", request)
        path = paths.snapshot_dir(self.state_dir, request.snapshot_id) if request.persist else ""
        return trainer_pb2.PushWeightsResponse(snapshot_id=request.snapshot_id, num_bytes=123, persisted_path=path)

    def SaveState(self, request, context):
        self._got("SaveState", request)
        directory = paths.checkpoint_dir(self.state_dir, request.model_id, request.kind, request.name)
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "adapter_model.safetensors"), "wb") as f:
            f.write(b"x" * 10)
        return trainer_pb2.SaveStateResponse(directory=directory, size_bytes=10)

    def UnloadModel(self, request, context):
        self._got("UnloadModel", request)
        return trainer_pb2.UnloadModelResponse(directory=paths.model_dir(self.state_dir, request.model_id))

    def SkipSeq(self, request, context):
        self._got("SkipSeq", request)
        return trainer_pb2.SkipSeqResponse()

    def GetQueueState(self, request, context):
        return trainer_pb2.QueueState()


class FakeSampler(sampler_pb2_grpc.SamplerServicer):
    def __init__(self):
        self.requests: list[sampler_pb2.SampleRequest] = []

    def Health(self, request, context):
        return common_pb2.HealthResponse(ready=True)

    def Sample(self, request, context):
        """Each sample is the prompt reversed, logprob -1 per token."""
        self.requests.append(request)
        reply = sampler_pb2.SampleResponse()
        for _ in range(request.num_samples):
            tokens = list(reversed(request.prompt_tokens))[:request.params.max_tokens]
            reply.sequences.add(tokens=tokens, logprobs=[-1.0] * len(tokens))
        return reply


def serve(servicer, add_to_server) -> tuple[grpc.Server, str]:
    server, port = create_server("127.0.0.1:0", max_workers=8)
    add_to_server(servicer, server)
    service_health = ServiceHealth(server)       # the gateway's sampler pool asks grpc.health.v1
    server.start()
    service_health.serving()
    return server, f"127.0.0.1:{port}"


class Api:
    """The HTTP calls a test makes, as the SDK makes them, with one user's API key."""

    def __init__(self, client: TestClient, api_key: str):
        self.client = client
        self.api_key = api_key

    def _headers(self, kwargs) -> dict:
        return {"X-API-Key": self.api_key, **kwargs.pop("headers", {})}

    def post(self, path: str, body=None, **kwargs):
        return self.client.post(f"/api/v1/{path}", json=body, headers=self._headers(kwargs), **kwargs)

    def get(self, path: str, **kwargs):
        return self.client.get(f"/api/v1/{path}", headers=self._headers(kwargs), **kwargs)

    def request(self, method: str, path: str, **kwargs):
        return self.client.request(method, f"/api/v1/{path}", headers=self._headers(kwargs), **kwargs)

    def as_user(self, name: str, **user) -> "Api":
        """The same gateway, called by another user (made if new) with a key of their own."""
        db = self.client.app.state.gateway.db
        key, _ = keys.create_key(db, keys.create_user(db, name, **user))
        return Api(self.client, key)

    def result(self, future: dict):
        """The finished future's response (retrieve_future long-polls until it is done)."""
        return self.post("retrieve_future", {"request_id": future["request_id"]})

    def session(self) -> str:
        return self.post("create_session", {"tags": []}).json()["session_id"]

    def model(self, session_id: str, rank: int = 8, model_seq_id: int = 0) -> str:
        future = self.post("create_model", {"session_id": session_id, "model_seq_id": model_seq_id,
                                            "base_model": "tiny/base",
                                            "lora_config": {"rank": rank}}).json()
        return self.result(future).json()["model_id"]


@contextlib.contextmanager
def fake_services(tmp_path, trainer, sampler, **settings):
    """`trainer` and `sampler` served over real gRPC; yields gateway settings pointing at them
    (`settings` overrides), and stops both servers after."""
    trainer_server, trainer_address = serve(trainer, trainer_pb2_grpc.add_TrainerServicer_to_server)
    sampler_server, sampler_address = serve(sampler, sampler_pb2_grpc.add_SamplerServicer_to_server)
    try:
        yield GatewaySettings(base_model=str(tmp_path / "base"), aliases=["tiny/base"], trainer=trainer_address,
                              samplers=[sampler_address], state_dir=str(tmp_path / "state"), **settings)
    finally:
        trainer_server.stop(0)
        sampler_server.stop(0)


@pytest.fixture
def gateway(tmp_path):
    trainer, sampler = FakeTrainer(str(tmp_path / "state")), FakeSampler()
    with fake_services(tmp_path, trainer, sampler) as settings, TestClient(create_app(settings)) as client:
        api = Api(client, "").as_user("tester", email="tester@example.com")
        client.headers["X-API-Key"] = api.api_key      # raw client calls act as the tester too
        yield types.SimpleNamespace(api=api, trainer=trainer, sampler=sampler, settings=settings)


def internal_client(client: TestClient) -> TestClient:
    """The same app as `client`, reached through the internal listener (gateway/listeners.py), on
    `client`'s event loop (the running backends' gRPC channels belong to it)."""
    from gateway.listeners import INTERNAL, Listener

    internal = TestClient(Listener(client.app, INTERNAL))
    internal.portal = client.portal
    return internal


def assert_user_error(response, status: int, *words: str) -> dict:
    body = response.json()
    assert response.status_code == status, body
    assert body["category"] == "user", body
    for word in words:
        assert word in body["error"], body
    return body
