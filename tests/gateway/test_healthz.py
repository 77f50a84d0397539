"""`GET /api/v1/healthz`: public, and ok only when the database answers, the trainer reports
SERVING over grpc.health.v1 and at least one sampler does (real in-process gRPC servers with the
fakes' servicers and the real health service; a real unreachable database)."""

from __future__ import annotations

import pytest
import sqlalchemy
from fastapi.testclient import TestClient

from gateway.app import create_app
from gateway.settings import GatewaySettings
from gateway_fakes import FakeSampler, FakeTrainer
from tinkerd import health, rpc
from tinkerd.v1 import sampler_pb2_grpc, trainer_pb2_grpc

TOKEN = "healthz-token"


def _serve(servicer, add, name):
    server, port = rpc.create_server("127.0.0.1:0", max_workers=4, auth=rpc.ServiceAuth(token=TOKEN))
    add(servicer, server)
    service_health = health.ServiceHealth(server, name)
    server.start()
    return server, f"127.0.0.1:{port}", service_health


@pytest.fixture
def parts(tmp_path):
    trainer = _serve(FakeTrainer(str(tmp_path / "state")), trainer_pb2_grpc.add_TrainerServicer_to_server,
                     "tinkerd.v1.Trainer")
    samplers = [_serve(FakeSampler(), sampler_pb2_grpc.add_SamplerServicer_to_server, "tinkerd.v1.Sampler")
                for _ in range(2)]
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    settings = GatewaySettings(base_model=str(tmp_path / "base"), trainer=trainer[1],
                               samplers=[s[1] for s in samplers], state_dir=str(tmp_path / "state"),
                               service_token_file=str(token_file))
    try:
        with TestClient(create_app(settings)) as client:
            yield client, trainer, samplers
    finally:
        for server, _, _ in (trainer, *samplers):
            server.stop(0)


def _healthz(client) -> tuple[int, dict]:
    r = client.get("/api/v1/healthz")          # no API key: public
    return r.status_code, r.json()


def test_ok_only_when_database_trainer_and_a_sampler_serve(parts):
    client, trainer, samplers = parts
    assert _healthz(client) == (503, {"status": "unavailable", "database": "ok", "trainer": "not serving",
                                      "samplers": "0/2 ok"})
    trainer[2].serving()
    assert _healthz(client)[0] == 503                                  # no sampler serving yet
    samplers[0][2].serving()
    assert _healthz(client) == (200, {"status": "ok", "database": "ok", "trainer": "ok", "samplers": "1/2 ok"})
    samplers[1][2].serving()
    assert _healthz(client)[1]["samplers"] == "2/2 ok"
    samplers[0][0].stop(0)                                             # one replica dies: still in service
    assert _healthz(client) == (200, {"status": "ok", "database": "ok", "trainer": "ok", "samplers": "1/2 ok"})
    trainer[2].stopping()                                              # the trainer shuts down
    assert _healthz(client)[1]["trainer"] == "not serving"
    trainer[0].stop(0)                                                 # and is gone
    code, body = _healthz(client)
    assert code == 503 and body["trainer"] == "unreachable"
    assert trainer[1] not in str(body)                                 # no addresses to the public


def test_an_unreachable_database_makes_it_unavailable(parts):
    client, trainer, samplers = parts
    trainer[2].serving()
    samplers[0][2].serving()
    assert _healthz(client)[0] == 200
    gw = client.app.state.gateway
    healthy_engine = gw.db.engine
    # A real database URL nobody listens at (port 9: discard, closed on loopback).
    gw.db.engine = sqlalchemy.create_engine("postgresql+psycopg://tinkerd@127.0.0.1:9/tinkerd")
    try:
        assert _healthz(client) == (503, {"status": "unavailable", "database": "unreachable", "trainer": "ok",
                                          "samplers": "1/2 ok"})
    finally:
        gw.db.engine = healthy_engine
    assert _healthz(client)[0] == 200
