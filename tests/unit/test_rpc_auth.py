"""Service authentication in tinkerd/rpc.py over real in-process gRPC (a Health servicer): the
token is required and checked, clients send it, and a server refuses to listen beyond loopback
unauthenticated. TLS is tested against the real trainer in tests/trainer/test_service_auth.py."""

import os
import stat

import grpc
import pytest

from launcher import up
from tinkerd import rpc
from tinkerd.v1 import common_pb2, sampler_pb2, sampler_pb2_grpc


class _Health(sampler_pb2_grpc.SamplerServicer):
    def Health(self, request, context):
        return common_pb2.HealthResponse(ready=True)


@pytest.fixture
def server():
    srv, port = rpc.create_server("127.0.0.1:0", max_workers=2, auth=rpc.ServiceAuth(token="t0ken"))
    sampler_pb2_grpc.add_SamplerServicer_to_server(_Health(), srv)
    srv.start()
    yield f"127.0.0.1:{port}"
    srv.stop(0)


@pytest.mark.parametrize("token", ["", "t0ke", "t0kenX", "T0KEN"])
def test_a_call_without_the_token_is_unauthenticated(server, token):
    stub = sampler_pb2_grpc.SamplerStub(rpc.channel(server, rpc.ServiceAuth(token=token)))
    with pytest.raises(grpc.RpcError) as e:
        stub.Health(common_pb2.HealthRequest(), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_clients_with_the_token_get_through(server):
    stub = sampler_pb2_grpc.SamplerStub(rpc.channel(server, rpc.ServiceAuth(token="t0ken")))
    assert stub.Health(common_pb2.HealthRequest(), timeout=10).ready
    assert stub.Health.future(common_pb2.HealthRequest(), timeout=10).result().ready

    async def aio():
        async with rpc.aio_channel(server, rpc.ServiceAuth(token="t0ken")) as ch:
            return await sampler_pb2_grpc.SamplerStub(ch).Health(common_pb2.HealthRequest(), timeout=10)
    import asyncio
    assert asyncio.run(aio()).ready


class _Echo(sampler_pb2_grpc.SamplerServicer):
    """Health answers ready only for a call that names the tenant it expects."""
    def Health(self, request, context):
        return common_pb2.HealthResponse(ready=dict(context.invocation_metadata()).get("x-tenant") == "alice")


def test_calls_with_metadata_send_the_token_and_the_metadata_of_their_moment():
    """The gateway's trainer calls (rpc.AioCallsWithMetadata): the token and the pairs made at
    call time, without aio interceptors; a caller's own metadata goes too."""
    import asyncio
    import contextvars

    srv, port = rpc.create_server("127.0.0.1:0", max_workers=2, auth=rpc.ServiceAuth(token="t0ken"))
    sampler_pb2_grpc.add_SamplerServicer_to_server(_Echo(), srv)
    srv.start()
    tenant = contextvars.ContextVar("tenant", default="")

    async def calls(token):
        async with rpc.aio_channel(f"127.0.0.1:{port}", rpc.ServiceAuth(token=token), send_token=False) as ch:
            stub = rpc.AioCallsWithMetadata(sampler_pb2_grpc.SamplerStub(ch), token,
                                            lambda: (("x-tenant", tenant.get()),))
            tenant.set("bob")
            bob = (await stub.Health(common_pb2.HealthRequest(), timeout=10)).ready
            tenant.set("alice")
            alice = (await stub.Health(common_pb2.HealthRequest(), timeout=10, metadata=(("x-other", "1"),))).ready
            return bob, alice
    try:
        assert asyncio.run(calls("t0ken")) == (False, True)
        with pytest.raises(grpc.aio.AioRpcError) as e:          # send_token=False: the channel sends none
            asyncio.run(calls(""))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        srv.stop(0)


@pytest.mark.parametrize("address", ["0.0.0.0:0", "[::]:0", "10.1.2.3:50051", "trainer.internal:1", ":50051"])
def test_non_loopback_needs_a_token_or_mtls(address):
    assert not rpc.is_loopback(address)
    with pytest.raises(SystemExit, match="without authentication"):
        rpc.check_exposure(address, rpc.ServiceAuth(), allow_insecure=False)
    with pytest.raises(SystemExit):      # server TLS alone authenticates nobody
        rpc.check_exposure(address, rpc.ServiceAuth(cert=b"c", key=b"k"), allow_insecure=False)
    rpc.check_exposure(address, rpc.ServiceAuth(token="t"), allow_insecure=False)
    rpc.check_exposure(address, rpc.ServiceAuth(cert=b"c", key=b"k", ca=b"a"), allow_insecure=False)
    rpc.check_exposure(address, rpc.ServiceAuth(), allow_insecure=True)


@pytest.mark.parametrize("address", ["127.0.0.1:0", "localhost:5", "[::1]:5", "127.0.0.2:1", "unix:/tmp/s"])
def test_loopback_may_go_without(address):
    assert rpc.is_loopback(address)
    rpc.check_exposure(address, rpc.ServiceAuth(), allow_insecure=False)


def test_up_makes_one_private_token_per_state_dir(tmp_path):
    path = up.service_token_file(str(tmp_path))
    token = open(path).read()
    assert len(token) >= 32 and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert up.service_token_file(str(tmp_path)) == path and open(path).read() == token
    assert "t0ken" not in repr(rpc.ServiceAuth(token="t0ken"))


class _Failing(sampler_pb2_grpc.SamplerServicer):
    def Health(self, request, context):
        raise RuntimeError("cannot open /srv/tinkerd/state/models/secret-user/optimizer.pt")

    def Sample(self, request, context):
        from tinkerd.errors import UserError
        raise UserError("max_tokens must be at least 1")


def test_an_unexpected_error_reaches_the_caller_as_an_incident_id_only(caplog):
    """A service's own failure text (server paths, types) stays in its log, under an id the
    caller is given; a ServiceError's message, written for the caller, goes through as it is."""
    srv, port = rpc.create_server("127.0.0.1:0", max_workers=2)
    sampler_pb2_grpc.add_SamplerServicer_to_server(_Failing(), srv)
    srv.start()
    try:
        stub = sampler_pb2_grpc.SamplerStub(rpc.channel(f"127.0.0.1:{port}"))
        with caplog.at_level("ERROR", logger="tinkerd.rpc"), pytest.raises(grpc.RpcError) as e:
            stub.Health(common_pb2.HealthRequest(), timeout=10)
        assert e.value.code() == grpc.StatusCode.INTERNAL
        details = e.value.details()
        assert "/srv/" not in details and "RuntimeError" not in details and "internal error in Health" in details
        incident = details.split("incident ")[1].split(":")[0]
        logged = [r for r in caplog.records if incident in r.getMessage()]
        assert logged and "optimizer.pt" in "".join(logged[0].exc_info and str(logged[0].exc_info[1]))
        with pytest.raises(grpc.RpcError) as e:
            stub.Sample(sampler_pb2.SampleRequest(), timeout=10)
        assert (e.value.code(), e.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be at least 1")
    finally:
        srv.stop(0)
