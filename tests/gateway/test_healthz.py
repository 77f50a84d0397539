"""`GET /api/v1/healthz`: public, and ok only when the database answers, the trainer reports
SERVING over grpc.health.v1 and at least one sampler does (real in-process gRPC servers with the
fakes' servicers and the real health service; a real unreachable database). The samplers' part
is the sampler pool's live set, which its own grpc.health.v1 checks (every second) keep: it
follows a replica's health within a check or two."""

from __future__ import annotations

import time

import pytest
import sqlalchemy
from fastapi.testclient import TestClient

from gateway.app import create_app
from gateway.listeners import INTERNAL, Listener
from gateway.routes import service
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
def parts(tmp_path, monkeypatch):
    monkeypatch.setattr(service, "CACHE_S", 0.0)          # these follow each change at once
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


def _samplers_become(client, expected: str, timeout_s: float = 10.0) -> tuple[int, dict]:
    """healthz once the pool's next checks have seen the replicas' new health."""
    deadline = time.monotonic() + timeout_s
    while (answer := _healthz(client))[1]["samplers"] != expected:
        assert time.monotonic() < deadline, answer
        time.sleep(0.1)
    return answer


def test_ok_only_when_database_trainer_and_a_sampler_serve(parts):
    client, trainer, samplers = parts
    assert _healthz(client) == (503, {"status": "unavailable", "database": "ok", "trainer": "not serving",
                                      "samplers": "0/2 ok"})
    trainer[2].serving()
    assert _healthz(client)[0] == 503                                  # no sampler serving yet
    samplers[0][2].serving()
    assert _samplers_become(client, "1/2 ok") == (200, {"status": "ok", "database": "ok", "trainer": "ok",
                                                        "samplers": "1/2 ok"})
    samplers[1][2].serving()
    _samplers_become(client, "2/2 ok")
    samplers[0][0].stop(0)                                             # one replica dies: still in service
    assert _samplers_become(client, "1/2 ok") == (200, {"status": "ok", "database": "ok", "trainer": "ok",
                                                        "samplers": "1/2 ok"})
    samplers[1][2].not_serving("its engine broke")                     # none left: out of service
    assert _samplers_become(client, "0/2 ok")[0] == 503
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
    assert _samplers_become(client, "1/2 ok")[0] == 200
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


def test_a_registered_replica_joins_the_pool_listing_and_healthz(parts):
    """A replica that registers (the path `tinkerd sampler --register-with` takes) is listed by
    GET /internal/v1/samplers/list once the pool's grpc.health.v1 check passes, counts in
    healthz, and leaves both when it deregisters; the listing wants the service token. Those routes
    are on the internal listener (gateway/listeners.py): a client of its own on the same app."""
    client, trainer, samplers = parts
    internal = TestClient(Listener(client.app, INTERNAL))
    trainer[2].serving()
    server, address, replica_health = _serve(FakeSampler(), sampler_pb2_grpc.add_SamplerServicer_to_server,
                                             "tinkerd.v1.Sampler")
    auth = {"authorization": f"Bearer {TOKEN}"}
    try:
        assert internal.get("/internal/v1/samplers/list").status_code == 401
        assert internal.get("/internal/v1/samplers/list", headers={"authorization": "Bearer wrong"}).status_code == 401
        assert internal.post("/internal/v1/samplers/register", json={"address": address}, headers=auth).status_code == 200
        replica_health.serving()
        assert _samplers_become(client, "1/3 ok")[0] == 200
        listed = {m["address"]: m for m in internal.get("/internal/v1/samplers/list", headers=auth).json()["samplers"]}
        assert listed[address] == {"address": address, "alive": True, "registered": True, "in_flight": 0, "served": 0,
                                   "weight_transport": ""}     # none pushed to it yet
        assert [m["alive"] for a, m in listed.items() if a != address] == [False, False]
        assert internal.post("/internal/v1/samplers/deregister", json={"address": address},
                           headers=auth).status_code == 200
        assert _samplers_become(client, "0/2 ok")[0] == 503
    finally:
        server.stop(0)


def test_rapid_calls_share_one_database_and_trainer_check(parts, monkeypatch):
    """Issue 24 L2: healthz is public; calls within CACHE_S of a check (sequential or at once from
    many threads) are answered from it: one trainer channel, one database ping. After CACHE_S the
    next call checks again and sees the trainer's new state."""
    import asyncio
    import concurrent.futures

    client, trainer, samplers = parts
    trainer[2].serving()
    samplers[0][2].serving()
    assert _samplers_become(client, "1/2 ok")[0] == 200
    probe = client.app.state.healthz_probe = service.Probe()      # nothing checked yet
    monkeypatch.setattr(service, "CACHE_S", 60.0)
    calls = []
    real_serving = service._serving

    async def counted(address, auth):
        calls.append(address)
        await asyncio.sleep(0.2)            # a slow trainer: the threads' calls arrive while it runs
        return await real_serving(address, auth)
    monkeypatch.setattr(service, "_serving", counted)
    with concurrent.futures.ThreadPoolExecutor(8) as threads:
        answers = list(threads.map(lambda _: _healthz(client), range(40)))
    assert answers == [(200, {"status": "ok", "database": "ok", "trainer": "ok", "samplers": "1/2 ok"})] * 40
    assert len(calls) == 1 and probe.checks == 1, (calls, probe.checks)
    trainer[2].stopping()
    assert _healthz(client)[1]["trainer"] == "ok" and len(calls) == 1        # still the cached check
    monkeypatch.setattr(service, "CACHE_S", 0.2)
    time.sleep(0.25)
    assert _healthz(client)[1]["trainer"] == "not serving" and len(calls) == 2
