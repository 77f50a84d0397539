"""The standard gRPC services every tinkerd server answers for tools and supervisors: health
(`grpc.health.v1`, what Kubernetes gRPC probes, grpc_health_probe and grpcurl ask) and server
reflection (so grpcurl needs no .proto files).

Health tells the truth about the process: NOT_SERVING until the service's engine is loaded and
the server started (`serving()`), NOT_SERVING again from the moment it starts shutting down
(`stopping()`, permanent), while something marks it unable to serve (`not_serving(reason)`),
and for good once it is broken beyond repair (`broken(reason)`: a trainer rank died, the process
is on its way out). The overall status (service "") and each named service move together.

Who may ask (tinkerd/rpc.py): `grpc.health.v1.Health/Check` needs no service token, because
kubelet's gRPC probe cannot send one; it reveals one status word. Watch, reflection and every
tinkerd method need the token. A probe still needs a TLS-free port, or this module's command:

    python -m tinkerd.health HOST:PORT [--service NAME] [--service-token-file F --tls-ca ...]

exits 0 when the server says SERVING (and prints the status), 1 otherwise: an exec probe for
TLS-only servers, and a container health check.
"""

from __future__ import annotations

import argparse
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class ServiceHealth:
    """The health and reflection services of one gRPC server, added before it starts."""

    def __init__(self, server: grpc.Server, *service_names: str):
        self._names = ("", *service_names)          # "": the server as a whole
        self._servicer = health.HealthServicer()
        for name in self._names:
            self._servicer.set(name, NOT_SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)
        reflection.enable_server_reflection((*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME),
                                            server)

    def serving(self) -> None:
        self._set(SERVING)

    def not_serving(self, reason: str) -> None:
        log.warning("health: NOT_SERVING (%s)", reason)
        self._set(NOT_SERVING)

    def broken(self, reason: str) -> None:
        """Broken for good (the process exits soon): NOT_SERVING from now on, whatever is set later."""
        log.error("health: NOT_SERVING for good (%s)", reason)
        self._servicer.enter_graceful_shutdown()

    def stopping(self) -> None:
        """Shutting down: NOT_SERVING from now on, whatever is set later."""
        self._servicer.enter_graceful_shutdown()

    def _set(self, status) -> None:
        for name in self._names:
            self._servicer.set(name, status)


def check(address: str, service: str = "", auth=None, timeout_s: float = 5.0) -> str:
    """The status name a server reports for `service` ("" = overall), e.g. "SERVING"; raises
    grpc.RpcError when it cannot be asked (down, refused, unknown service)."""
    from tinkerd.rpc import ServiceAuth, channel

    with channel(address, auth or ServiceAuth()) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                     timeout=timeout_s)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def build_parser() -> argparse.ArgumentParser:
    from tinkerd import settings
    from tinkerd.rpc import ServiceAuthSettings

    parser = argparse.ArgumentParser(prog="python -m tinkerd.health",
                                     description="exit 0 when a tinkerd gRPC server reports SERVING")
    parser.add_argument("address", help="host:port of the trainer or a sampler")
    parser.add_argument("--service", default="", help="a service name (default: the server as a whole)")
    parser.add_argument("--timeout-s", type=float, default=5.0)
    settings.add_arguments(parser, ServiceAuthSettings)
    return parser


def main(argv: list[str] | None = None) -> int:
    from tinkerd import settings
    from tinkerd.rpc import ServiceAuth, ServiceAuthSettings

    args = build_parser().parse_args(argv)
    try:
        status = check(args.address, args.service, ServiceAuth.of(settings.from_args(ServiceAuthSettings, args)),
                       args.timeout_s)
    except grpc.RpcError as e:
        print(f"{args.address}: {e.code().name}: {e.details()}")
        return 1
    print(f"{args.address}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    raise SystemExit(main())
