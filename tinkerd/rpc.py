"""gRPC plumbing shared by the services: server construction, channels, service authentication,
and the boundary that turns exceptions into status codes.

Service authentication (all of it is here): a server given a shared token refuses every call
whose `authorization: Bearer <token>` metadata is missing or wrong with UNAUTHENTICATED, except
the standard health check (`grpc.health.v1.Health/Check`: kubelet's gRPC probe cannot send a
token, and it reveals one status word; tinkerd's own Health, Watch and reflection need the
token, see tinkerd/health.py); given a certificate it serves TLS, and given
a CA as well it requires client certificates signed by it (mTLS). Clients send the token and
speak TLS with the same settings. A server refuses to listen beyond loopback unauthenticated.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hmac
import ipaddress
import json
import logging
import socket
from typing import Callable, Iterable

import grpc

from tinkerd.errors import ServiceError
from tinkerd.metrics import RpcMetrics
from tinkerd.settings import setting

log = logging.getLogger(__name__)

# Training batches and weight manifests can be large; the default 4 MiB cap is not enough.
MAX_MESSAGE_BYTES = 512 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


@dataclasses.dataclass(kw_only=True)
class ServiceAuthSettings:
    """Settings of every service that calls or serves gRPC (one shared flag each under `tinkerd up`)."""
    service_token_file: str = setting("", help="file holding the shared service token: servers refuse gRPC "
                                               "calls without it, clients send it (tinkerd up makes one)")
    tls_cert: str = setting("", help="PEM certificate: servers serve TLS with it, clients present it (mTLS)")
    tls_key: str = setting("", help="PEM private key of --tls-cert")
    tls_ca: str = setting("", help="PEM CA bundle: clients verify servers with it (else TLS only with "
                                   "--tls-cert); servers given it require client certificates (mTLS)")


@dataclasses.dataclass(kw_only=True)
class ServerAuthSettings(ServiceAuthSettings):
    allow_insecure: bool = setting(False, help="serve gRPC on a non-loopback --listen without a token or "
                                               "mTLS: anyone who reaches the port controls the service")


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@dataclasses.dataclass(frozen=True, repr=False)
class ServiceAuth:
    """The loaded credentials (repr=False: the token must not reach a log)."""
    token: str = ""
    cert: bytes = b""
    key: bytes = b""
    ca: bytes = b""

    @classmethod
    def of(cls, s: ServiceAuthSettings) -> "ServiceAuth":
        token = _read(s.service_token_file).decode().strip() if s.service_token_file else ""
        if s.service_token_file and not token:
            raise ValueError(f"the service token file {s.service_token_file} is empty")
        if bool(s.tls_cert) != bool(s.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        return cls(token, *(_read(p) if p else b"" for p in (s.tls_cert, s.tls_key, s.tls_ca)))

    @property
    def tls(self) -> bool:
        return bool(self.cert or self.ca)

    @property
    def authenticates(self) -> bool:
        """Whether a server with these credentials refuses unknown callers (token, or mTLS)."""
        return bool(self.token or (self.cert and self.ca))


def is_loopback(address: str) -> bool:
    if address.startswith("unix:"):
        return True
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False        # a host name or "" (every interface): assume reachable from elsewhere


def advertised_host(listen: str) -> str:
    """The host other processes are told to reach a server listening at `listen` by (the rule
    every service follows where no flag names it): 127.0.0.1 for a loopback listener; the
    address itself for one interface; for every interface (0.0.0.0, ::, ""), this host's
    address as its own name resolves here (a container's or pod's IP: Docker and Kubernetes map
    the hostname to it), or the name itself where it maps to loopback or nowhere."""
    host = listen.rsplit(":", 1)[0].strip("[]")
    if is_loopback(f"{host}:0"):
        return "127.0.0.1"
    if host not in ("0.0.0.0", "::", ""):
        return host
    name = socket.gethostname()
    try:
        ip = socket.gethostbyname(name)
    except OSError:
        return name
    return name if ipaddress.ip_address(ip).is_loopback else ip


def is_local_address(host: str) -> bool:
    """Whether `host` names an address of this host (a socket can be bound to it)."""
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as probe:
            probe.bind(infos[0][4])
    except OSError:
        return False
    return True


def check_exposure(address: str, auth: ServiceAuth, allow_insecure: bool) -> None:
    """A server reachable from other hosts must authenticate its callers."""
    if is_loopback(address) or allow_insecure:
        return
    if not auth.authenticates:
        raise SystemExit(f"refusing to serve gRPC on {address} without authentication: give "
                         f"--service-token-file (with --tls-cert/--tls-key) or mTLS (--tls-cert, --tls-key, "
                         f"--tls-ca), listen on 127.0.0.1, or pass --allow-insecure (see deploy/README.md)")
    if not auth.tls:
        log.warning("serving gRPC on %s without TLS: the service token crosses the network in clear", address)


# Methods any caller may use without the token (see the module docstring).
OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check"})


def _unauthenticated(request, context):
    context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong service token")


# The refusal must have the refused method's shape (reflection and Health/Watch stream).
_REFUSE = {(False, False): grpc.unary_unary_rpc_method_handler(_unauthenticated),
           (False, True): grpc.unary_stream_rpc_method_handler(_unauthenticated),
           (True, False): grpc.stream_unary_rpc_method_handler(_unauthenticated),
           (True, True): grpc.stream_stream_rpc_method_handler(_unauthenticated)}


class _RequireToken(grpc.ServerInterceptor):
    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation, details):
        if details.method in OPEN_METHODS:
            return continuation(details)
        given = next((v for k, v in details.invocation_metadata or () if k == "authorization"), "")
        if hmac.compare_digest(given.encode() if isinstance(given, str) else given, self._expected):
            return continuation(details)
        handler = continuation(details)
        shape = (handler.request_streaming, handler.response_streaming) if handler else (False, False)
        return _REFUSE[shape]


def create_server(address: str, *, max_workers: int = 32, auth: ServiceAuth = ServiceAuth(),
                  allow_insecure: bool = False) -> tuple[grpc.Server, int]:
    """A threaded server bound to `address` (port 0 picks one); returns it with its port."""
    from concurrent import futures

    check_exposure(address, auth, allow_insecure)
    if auth.ca and not auth.cert:
        raise SystemExit("--tls-ca on a server needs --tls-cert and --tls-key")
    interceptors = [_RequireToken(auth.token)] if auth.token else []
    interceptors.append(RpcMetrics())           # tinkerd_rpc_duration_seconds, by method and code
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=CHANNEL_OPTIONS,
                         interceptors=interceptors)
    if auth.cert:
        credentials = grpc.ssl_server_credentials([(auth.key, auth.cert)], root_certificates=auth.ca or None,
                                                  require_client_auth=bool(auth.ca))
        port = server.add_secure_port(address, credentials)
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"could not bind gRPC server to {address}")
    return server, port


def _channel_credentials(auth: ServiceAuth) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(root_certificates=auth.ca or None, private_key=auth.key or None,
                                        certificate_chain=auth.cert or None)


class _CallDetails(collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials",
                                                           "wait_for_ready", "compression")),
                   grpc.ClientCallDetails):
    pass


def _token_header(token: str) -> tuple[str, str]:
    """The metadata pair that carries the service token on a call."""
    return ("authorization", f"Bearer {token}")


class _SendToken(grpc.UnaryUnaryClientInterceptor):
    def __init__(self, token: str):
        self._header = _token_header(token)

    def intercept_unary_unary(self, continuation, details, request):
        metadata = [*(details.metadata or ()), self._header]
        return continuation(_CallDetails(details.method, details.timeout, metadata, details.credentials,
                                         details.wait_for_ready, details.compression), request)


class _SendTokenAio(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: str):
        self._header = _token_header(token)

    async def intercept_unary_unary(self, continuation, details, request):
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self._header)
        return await continuation(details._replace(metadata=metadata), request)


def channel(address: str, auth: ServiceAuth = ServiceAuth()) -> grpc.Channel:
    if auth.tls:
        ch = grpc.secure_channel(address, _channel_credentials(auth), options=CHANNEL_OPTIONS)
    else:
        ch = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.intercept_channel(ch, _SendToken(auth.token)) if auth.token else ch


def resilient_calls(service: str, timeout_s: float) -> list[tuple[str, object]]:
    """Channel options under which every call to `service` has a deadline, waits for a service
    that is (re)starting instead of failing at once, and is resent when the connection drops
    mid-call. Only for services whose every method is safe to resend: the trainer answers a
    resent (model_id, seq_id) without applying it twice, and sampling changes nothing."""
    config = {"methodConfig": [{
        "name": [{"service": service}],
        "waitForReady": True,
        "timeout": f"{timeout_s:.3f}s",
        "retryPolicy": {"maxAttempts": 5, "initialBackoff": "0.5s", "maxBackoff": "10s",
                        "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]},
    }]}
    return [("grpc.service_config", json.dumps(config)), ("grpc.enable_retries", 1),
            # Requests are kept for a resend up to these sizes (gRPC's default is 256 KiB).
            ("grpc.per_rpc_retry_buffer_size", MAX_MESSAGE_BYTES), ("grpc.retry_buffer_size", (1 << 31) - 1)]


def deadline_calls(service: str, timeout_s: float) -> list[tuple[str, object]]:
    """Channel options under which every call to `service` has a deadline and fails at once
    when the service is down (the caller picks another replica)."""
    config = {"methodConfig": [{"name": [{"service": service}], "timeout": f"{timeout_s:.3f}s"}]}
    return [("grpc.service_config", json.dumps(config)), ("grpc.enable_retries", 0)]


# The gRPC metadata in which the gateway names the user a trainer call is for: the trainer's fair
# scheduler shares its time among these tenants (trainer_service/scheduler.py).
TENANT_METADATA = "x-tinkerd-tenant"


def user_tenant(user_id: str) -> str:
    """The scheduler tenant of a user (apart from the session ids the trainer falls back on)."""
    return f"user:{user_id}"


def aio_channel(address: str, auth: ServiceAuth = ServiceAuth(), options=(), interceptors=(),
                send_token: bool = True) -> grpc.aio.Channel:
    """`send_token` False: the caller sends the service token itself (AioCallsWithMetadata)."""
    token = [_SendTokenAio(auth.token)] if auth.token and send_token else []
    interceptors = [*interceptors, *token] or None
    options = [*CHANNEL_OPTIONS, *options]
    if auth.tls:
        return grpc.aio.secure_channel(address, _channel_credentials(auth), options=options,
                                       interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)


class AioCallsWithMetadata:
    """A grpc.aio stub whose every call carries the service token and the pairs `metadata()`
    makes at call time. Added per call rather than by aio interceptors: grpc.aio runs an
    intercepted call as a task of its own before it sends it, a turn of the event loop in which
    whatever else is ready runs first, and the request reaches the trainer later
    (docs/benchmarks.md#in-the-gateway-and-every-process)."""

    def __init__(self, stub, token: str, metadata: Callable[[], Iterable[tuple[str, str]]] = tuple):
        self._stub, self._metadata = stub, metadata
        self._token = (_token_header(token),) if token else ()

    def __getattr__(self, method: str):
        call = getattr(self._stub, method)

        def with_metadata(request, *, metadata=(), **kwargs):
            return call(request, metadata=(*metadata, *self._token, *self._metadata()), **kwargs)
        setattr(self, method, with_metadata)        # made once per method
        return with_metadata


def rpc_boundary(method):
    """Servicer decorator: ServiceError -> its status code; anything else -> INTERNAL, logged."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except ServiceError as e:
            context.abort(e.code, str(e))
        except Exception as e:  # noqa: BLE001 - the boundary must answer, never crash the server
            log.exception("%s failed", method.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")

    return wrapper
