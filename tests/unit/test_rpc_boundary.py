"""Every method of every service a tinkerd server serves passes the one boundary create_server
puts around its calls (tinkerd/rpc.py): the trainer's and the sampler's methods and the library
services beside them (grpc.health.v1, reflection), as the server itself lists them through
reflection. Without the service token each is refused (but the open health Check); with it each
gets through, a unary one timed in tinkerd_rpc_duration_seconds under its status code, and a
servicer's own failure answered as INTERNAL with an incident id only. Real gRPC, in-process."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import descriptor_pool, message_factory
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client import REGISTRY

from tinkerd import health, rpc
from tinkerd.v1 import sampler_pb2_grpc, trainer_pb2_grpc

SECRET = "boundary-test-secret"
WITH_TOKEN = (("authorization", f"Bearer {SECRET}"),)      # the operator's (the secret itself)
SERVERS = {"trainer": ("tinkerd.v1.Trainer", trainer_pb2_grpc.TrainerServicer,
                       trainer_pb2_grpc.add_TrainerServicer_to_server),
           "sampler": ("tinkerd.v1.Sampler", sampler_pb2_grpc.SamplerServicer,
                       sampler_pb2_grpc.add_SamplerServicer_to_server)}


def _failing(name: str):
    def method(self, request, context):
        raise RuntimeError(f"{name} read /srv/secret-path")
    return method


@pytest.fixture(params=sorted(SERVERS))
def served(request):
    """A server as `tinkerd trainer` / `tinkerd sampler` builds one (create_server, the service,
    health and reflection), its service's every method failing inside the servicer."""
    service, base, add = SERVERS[request.param]
    methods = descriptor_pool.Default().FindServiceByName(service).methods
    failing = type("Failing", (base,), {m.name: _failing(m.name) for m in methods})
    server, port = rpc.create_server("127.0.0.1:0", max_workers=4, auth=rpc.ServiceAuth(SECRET, role=request.param))
    add(failing(), server)
    health.ServiceHealth(server, service).serving()
    server.start()
    yield f"127.0.0.1:{port}", service
    server.stop(0)


def _served_methods(address: str):
    """Every method of every service the server lists through reflection."""
    reply = next(reflection_pb2_grpc.ServerReflectionStub(rpc.channel(address)).ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), metadata=WITH_TOKEN, timeout=10))
    pool = descriptor_pool.Default()
    return [method for service in reply.list_services_response.service
            for method in pool.FindServiceByName(service.name).methods]


def _call(ch: grpc.Channel, method, metadata):
    """One call of `method` with an empty request; its first reply (streams: one request)."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    request = message_factory.GetMessageClass(method.input_type)()
    reply = message_factory.GetMessageClass(method.output_type)
    if method.input_type.name == "ServerReflectionRequest":
        request.list_services = ""
    kinds = {(False, False): ch.unary_unary, (False, True): ch.unary_stream, (True, True): ch.stream_stream}
    call = kinds[method.client_streaming, method.server_streaming](
        path, request_serializer=type(request).SerializeToString, response_deserializer=reply.FromString)
    if method.client_streaming:
        return next(call(iter([request]), metadata=metadata, timeout=10))
    reply = call(request, metadata=metadata, timeout=10)
    return next(reply) if method.server_streaming else reply


def _code(ch: grpc.Channel, method, metadata=()) -> tuple[grpc.StatusCode, str]:
    try:
        _call(ch, method, metadata)
    except grpc.RpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


def _timed(name: str, code: grpc.StatusCode) -> float:
    labels = {"method": name, "code": code.name}
    return REGISTRY.get_sample_value("tinkerd_rpc_duration_seconds_count", labels) or 0.0


def test_every_method_of_every_service_passes_the_boundary(served):
    address, service = served
    methods = _served_methods(address)
    assert {m.containing_service.full_name for m in methods} == {
        service, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
    ch = rpc.channel(address)
    for method in methods:
        path = f"/{method.containing_service.full_name}/{method.name}"
        unary = not (method.client_streaming or method.server_streaming)
        refused, _ = _code(ch, method)
        if path in rpc.OPEN_METHODS:
            assert refused == grpc.StatusCode.OK, path
        else:
            assert refused == grpc.StatusCode.UNAUTHENTICATED, path
        before = {code: _timed(method.name, code) for code in grpc.StatusCode}
        code, details = _code(ch, method, WITH_TOKEN)
        if method.containing_service.full_name == service:      # the servicer's own failure, text withheld
            assert code == grpc.StatusCode.INTERNAL, path
            assert f"internal error in {method.name} (incident " in details and "/srv/" not in details, path
        else:       # the library's own answer (OK; UNIMPLEMENTED for a method its servicer lacks, Health/List)
            assert code in (grpc.StatusCode.OK, grpc.StatusCode.UNIMPLEMENTED), path
        if unary:
            assert {c: _timed(method.name, c) - n for c, n in before.items() if _timed(method.name, c) != n} \
                == {code: 1.0}, path
