"""The standard gRPC health and reflection services (tinkerd/health.py) over real gRPC: in-process
servers built by tinkerd/rpc.py's create_server (token and mTLS), and a real `tinkerd trainer`
process that reports SERVING once started and NOT_SERVING when told to stop."""

from __future__ import annotations

import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from conftest import start_trainer_process
from test_service_auth import _make_pki
from tinkerd import health, rpc
from tinkerd.v1 import common_pb2, sampler_pb2_grpc

TOKEN = "health-test-token"
SAMPLER = "tinkerd.v1.Sampler"


class _Sampler(sampler_pb2_grpc.SamplerServicer):
    def Health(self, request, context):
        return common_pb2.HealthResponse(ready=True)


def _server(auth: rpc.ServiceAuth):
    server, port = rpc.create_server("127.0.0.1:0", max_workers=4, auth=auth)
    sampler_pb2_grpc.add_SamplerServicer_to_server(_Sampler(), server)
    service_health = health.ServiceHealth(server, SAMPLER)
    server.start()
    return server, f"127.0.0.1:{port}", service_health


@pytest.fixture
def served():
    server, address, service_health = _server(rpc.ServiceAuth(token=TOKEN))
    yield address, service_health
    server.stop(0)


def _check(address: str, service: str = "", token: str = "") -> str:
    return health.check(address, service, rpc.ServiceAuth(token=token))


def test_not_serving_until_started_then_serving_until_stopping(served):
    address, service_health = served
    assert _check(address) == _check(address, SAMPLER) == "NOT_SERVING"
    service_health.serving()
    assert _check(address) == _check(address, SAMPLER) == "SERVING"
    service_health.not_serving("the engine is reloading")
    assert _check(address) == "NOT_SERVING"
    service_health.serving()
    assert _check(address) == "SERVING"
    service_health.broken("a rank died")
    service_health.serving()                 # broken is for good (the process is exiting)
    assert _check(address) == _check(address, SAMPLER) == "NOT_SERVING"
    service_health.stopping()
    service_health.serving()                 # too late: shutting down is for good
    assert _check(address) == _check(address, SAMPLER) == "NOT_SERVING"
    with pytest.raises(grpc.RpcError) as e:
        _check(address, "tinkerd.v1.NoSuchService")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_only_health_check_is_open_without_the_token(served):
    """kubelet's gRPC probe sends no metadata: Check answers it; everything else wants the token."""
    address, service_health = served
    service_health.serving()
    assert _check(address, token="") == _check(address, token="wrong") == _check(address, token=TOKEN) == "SERVING"

    def refused(token: str) -> list[grpc.StatusCode]:
        ch = rpc.channel(address, rpc.ServiceAuth(token=token))
        codes = []
        for call in (lambda: sampler_pb2_grpc.SamplerStub(ch).Health(common_pb2.HealthRequest(), timeout=10),
                     lambda: next(health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=10)),
                     lambda: next(reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                         iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))):
            with pytest.raises(grpc.RpcError) as e:
                call()
            codes.append(e.value.code())
        return codes

    assert refused("") == refused("wrong") == [grpc.StatusCode.UNAUTHENTICATED] * 3


def test_watch_and_reflection_with_the_token(served):
    address, service_health = served
    ch = grpc.insecure_channel(address)
    metadata = [("authorization", f"Bearer {TOKEN}")]
    watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=SAMPLER), metadata=metadata,
                                                 timeout=10)
    assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
    service_health.serving()
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    watch.cancel()
    replies = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services=""),
              reflection_pb2.ServerReflectionRequest(file_containing_symbol=SAMPLER)]), metadata=metadata, timeout=10)
    listed, described = list(replies)
    assert {s.name for s in listed.list_services_response.service} == {
        SAMPLER, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
    assert described.file_descriptor_response.file_descriptor_proto      # grpcurl can describe Sample etc.


def test_the_probe_command_speaks_token_and_mtls(tmp_path, capsys):
    """`python -m tinkerd.health` is the exec probe for TLS-only servers (kubelet's gRPC probe
    speaks no TLS) and the compose health check."""
    pki = _make_pki(tmp_path)
    read = lambda p: open(p, "rb").read()  # noqa: E731
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    server, address, service_health = _server(rpc.ServiceAuth(token=TOKEN, cert=read(pki["cert"]),
                                                               key=read(pki["key"]), ca=read(pki["ca"])))
    try:
        tls = ["--tls-ca", pki["ca"], "--tls-cert", pki["cert"], "--tls-key", pki["key"]]
        assert health.main([address, *tls]) == 1
        assert "NOT_SERVING" in capsys.readouterr().out
        service_health.serving()
        assert health.main([address, *tls]) == 0
        assert health.main([address, "--service", SAMPLER, *tls, "--service-token-file", str(token_file)]) == 0
        assert "SERVING" in capsys.readouterr().out
        assert health.main([address, "--timeout-s", "3"]) == 1          # plaintext at a TLS port
        assert "UNAVAILABLE" in capsys.readouterr().out
    finally:
        server.stop(0)


def test_a_real_trainer_is_serving_once_ready_and_not_serving_when_stopping(tiny_model_dir, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    proc, port = start_trainer_process(tiny_model_dir, str(tmp_path / "state"), "--service-token-file", str(token_file))
    try:
        address = f"127.0.0.1:{port}"
        assert _check(address) == _check(address, "tinkerd.v1.Trainer") == "SERVING"
        watch = health_pb2_grpc.HealthStub(grpc.insecure_channel(address)).Watch(
            health_pb2.HealthCheckRequest(), metadata=[("authorization", f"Bearer {TOKEN}")], timeout=60)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        proc.send_signal(signal.SIGTERM)
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
