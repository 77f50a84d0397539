"""gRPC plumbing shared by the services: server construction, channels, service authentication,
and the one boundary every call a server takes passes (`_Boundary`): the token checked, the call
timed, exceptions turned into status codes.

Service authentication (all of it is here): a server given the shared secret, or its role's
credential (tinkerd/service_roles.py), refuses every call whose `authorization: Bearer <token>`
metadata is missing or wrong with UNAUTHENTICATED, except the standard health check
(`grpc.health.v1.Health/Check`: kubelet's gRPC probe cannot send a token, and it reveals one
status word; tinkerd's own Health, Watch and reflection need the token, see tinkerd/health.py),
and a call whose token's role may not use the method with PERMISSION_DENIED, naming the role.
Clients present their role's token for the service they call (the secret itself is the
operator's credential, for tools). Given a certificate a server serves TLS, and given a CA as
well it requires client certificates signed by it (mTLS). Clients speak TLS with the same
settings. A server refuses to listen beyond loopback unauthenticated.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hmac
import ipaddress
import json
import logging
import secrets
import socket
import time
from typing import Callable, Iterable

import grpc

from tinkerd import service_roles
from tinkerd.errors import ServiceError
from tinkerd.metrics import RPC_SECONDS
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
    service_token_file: str = setting("", help="file holding the shared service secret (tinkerd up makes one), or "
                                               "this service's credential derived from it (python -m "
                                               "tinkerd.service_roles): each service presents its role's token, "
                                               "servers refuse calls without one its role may make")
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
    """The loaded credentials (repr=False: no token may reach a log). `token` is the shared
    secret, from which every role's tokens derive; `credential` instead, a role's credential file
    (its own tokens, and digests of those its service accepts)."""
    token: str = ""
    cert: bytes = b""
    key: bytes = b""
    ca: bytes = b""
    role: str = "operator"
    credential: dict | None = None

    @classmethod
    def of(cls, s: ServiceAuthSettings, role: str = "") -> "ServiceAuth":
        """`role`: the service these settings are for ("" takes a credential file's, else the operator)."""
        text = _read(s.service_token_file).decode().strip() if s.service_token_file else ""
        if s.service_token_file and not text:
            raise ValueError(f"the service token file {s.service_token_file} is empty")
        if bool(s.tls_cert) != bool(s.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        pem = (_read(p) if p else b"" for p in (s.tls_cert, s.tls_key, s.tls_ca))
        credential = service_roles.parse_credential(text)
        if credential is None:
            return cls(text, *pem, role=role or "operator")
        if role and credential["role"] != role:
            raise ValueError(f"{s.service_token_file} is the {credential['role']} service's credential, not the "
                             f"{role}'s: give this service its own (python -m tinkerd.service_roles {role})")
        return cls("", *pem, role=credential["role"], credential=credential)

    def bearer(self, audience: str) -> str:
        """The token this service presents to `audience`'s servers ("" when it holds none)."""
        if self.credential is not None:
            return self.credential["send"].get(audience, "")
        return service_roles.derive(self.token, self.role, audience) if self.token else ""

    def bearer_for(self, method: str, audience: str = "") -> str:
        """The token for a call of `method`: its service's audience's, else `audience`'s; with
        neither known, the secret itself (an operator's tool calling reflection, say)."""
        audience = service_roles.audience_of(method) or audience
        return self.bearer(audience) if audience else self.token

    def caller_role(self, given: str, audience: str) -> str:
        """The role whose token `given` is for `audience` ("" if none): the secret itself is the operator's."""
        if self.token and hmac.compare_digest(given.encode("latin-1", "replace"), self.token.encode()):
            return "operator"
        role = service_roles.role_of(given)
        if not role or not audience:
            return ""
        if self.credential is not None:
            expected = self.credential["accept"].get(role) if audience == self.credential["role"] else None
        else:
            expected = _expected_digest(self.token, role, audience) if self.token else None
        if expected is None:
            return ""
        return role if hmac.compare_digest(service_roles.digest(given), expected) else ""

    @property
    def holds_token(self) -> bool:
        return bool(self.token or self.credential)

    @property
    def tls(self) -> bool:
        return bool(self.cert or self.ca)

    @property
    def authenticates(self) -> bool:
        """Whether a server with these credentials refuses unknown callers (token, or mTLS)."""
        return bool(self.holds_token or (self.cert and self.ca))


@functools.lru_cache(maxsize=64)
def _expected_digest(secret: str, role: str, audience: str) -> str:
    return service_roles.digest(service_roles.derive(secret, role, audience))


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


def _refusal(code: grpc.StatusCode, message: str, shape: tuple[bool, bool]):
    """A handler that refuses with `code`, of the refused method's shape (reflection and
    Health/Watch stream)."""
    def refuse(request, context):
        context.abort(code, message)
    make = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    return make[shape](refuse)


class _Boundary(grpc.ServerInterceptor):
    """The one boundary of every call to a server made by create_server, whatever its service:
    tinkerd's own and the library servicers of grpc.health.v1 and reflection alike (no decorator
    reaches those, and a servicer's context does not say which method it serves, which the
    per-role check needs). When a call arrives, before its request is parsed: its token must be a
    role's for the method's service (else for this server's own, for grpc.health.v1 and
    reflection) and that role may call the method. A unary call then runs inside `answering`,
    the one frame of ours between gRPC and the servicer method; streams (Watch, reflection) run
    as they are."""

    def __init__(self, auth: ServiceAuth):
        self._auth = auth
        self._own = auth.role if auth.role in service_roles.AUDIENCES else ""

    def intercept_service(self, continuation, details):
        refused = self._refused(details) if self._auth.holds_token else None
        handler = continuation(details)
        if refused is not None:
            shape = (handler.request_streaming, handler.response_streaming) if handler else (False, False)
            return _refusal(*refused, shape)
        if handler is None or handler.request_streaming or handler.response_streaming:
            return handler      # an unknown method (UNIMPLEMENTED), or a stream: untimed, as it is
        return grpc.unary_unary_rpc_method_handler(answering(handler.unary_unary, details.method),
                                                   request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)

    def _refused(self, details) -> tuple[grpc.StatusCode, str] | None:
        """Why the call is refused (its status code and message), None if it may go on."""
        method = details.method
        if method in OPEN_METHODS:
            return None
        given = next((v for k, v in details.invocation_metadata or () if k == "authorization"), "")
        given = given.decode("latin-1") if isinstance(given, bytes) else given
        audience = service_roles.audience_of(method) or self._own
        role = self._auth.caller_role(given[7:] if given.startswith("Bearer ") else "", audience)
        if role == "operator" or (role and service_roles.allows(audience, role, method)):
            return None
        if not role:
            return grpc.StatusCode.UNAUTHENTICATED, "missing or wrong service token"
        return (grpc.StatusCode.PERMISSION_DENIED,
                f"the {role} service's token may not call {method} (it opens "
                f"{service_roles.opens(audience, role)} of the {audience})")


def answering(behavior, method: str):
    """`behavior(request, context)` as a server made by create_server runs a unary call of
    `method` ("/package.Service/Name"), in one frame: timed into tinkerd_rpc_duration_seconds by
    method and status code; a ServiceError answered with its code and message; anything else with
    INTERNAL and an incident id only (the exception's text names server-side types, paths and
    values no user should see), its traceback logged under that id. A status the method chose
    itself (context.abort, or set_code as the generated base servicers do) is kept."""
    name = method.rsplit("/", 1)[-1]

    def answer(request, context):
        t0 = time.perf_counter()
        failed = True
        try:
            reply = behavior(request, context)
            failed = False
            return reply
        except ServiceError as e:
            context.abort(e.code, str(e))
        except Exception:  # noqa: BLE001 - the boundary must answer, never crash the server
            if context.code() is not None:
                raise
            incident = secrets.token_hex(6)
            log.exception("%s failed (incident %s)", name, incident)
            context.abort(grpc.StatusCode.INTERNAL, f"internal error in {name} (incident {incident}: "
                                                    f"the operator finds the detail in the service's log)")
        finally:
            code = _code_name(context.code()) or ("UNKNOWN" if failed else "OK")
            RPC_SECONDS.labels(name, code).observe(time.perf_counter() - t0)
    return answer


def _code_name(code) -> str | None:
    """context.code() is a StatusCode, an int, or None depending on how it was set."""
    if code is None:
        return None
    if isinstance(code, grpc.StatusCode):
        return code.name
    return next((c.name for c in grpc.StatusCode if c.value[0] == code), str(code))


def create_server(address: str, *, max_workers: int = 32, auth: ServiceAuth = ServiceAuth(),
                  allow_insecure: bool = False) -> tuple[grpc.Server, int]:
    """A threaded server bound to `address` (port 0 picks one); returns it with its port."""
    from concurrent import futures

    check_exposure(address, auth, allow_insecure)
    if auth.ca and not auth.cert:
        raise SystemExit("--tls-ca on a server needs --tls-cert and --tls-key")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=CHANNEL_OPTIONS,
                         interceptors=[_Boundary(auth)])
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
    """The metadata pair that carries a service token on a call."""
    return ("authorization", f"Bearer {token}")


class _SendToken(grpc.UnaryUnaryClientInterceptor):
    def __init__(self, auth: ServiceAuth, audience: str):
        self._auth, self._audience = auth, audience

    def intercept_unary_unary(self, continuation, details, request):
        token = self._auth.bearer_for(details.method, self._audience)
        metadata = [*(details.metadata or ()), *((_token_header(token),) if token else ())]
        return continuation(_CallDetails(details.method, details.timeout, metadata, details.credentials,
                                         details.wait_for_ready, details.compression), request)


class _SendTokenAio(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, auth: ServiceAuth, audience: str):
        self._auth, self._audience = auth, audience

    async def intercept_unary_unary(self, continuation, details, request):
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        token = self._auth.bearer_for(method, self._audience)
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *((_token_header(token),) if token else ()))
        return await continuation(details._replace(metadata=metadata), request)


def channel(address: str, auth: ServiceAuth = ServiceAuth(), audience: str = "") -> grpc.Channel:
    """`audience`: the service at `address` ("trainer", "sampler"), for calls whose method does not name it."""
    if auth.tls:
        ch = grpc.secure_channel(address, _channel_credentials(auth), options=CHANNEL_OPTIONS)
    else:
        ch = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.intercept_channel(ch, _SendToken(auth, audience)) if auth.holds_token else ch


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
                send_token: bool = True, audience: str = "") -> grpc.aio.Channel:
    """`send_token` False: the caller sends its token itself (AioCallsWithMetadata); `audience` as for channel."""
    token = [_SendTokenAio(auth, audience)] if auth.holds_token and send_token else []
    interceptors = [*interceptors, *token] or None
    options = [*CHANNEL_OPTIONS, *options]
    if auth.tls:
        return grpc.aio.secure_channel(address, _channel_credentials(auth), options=options,
                                       interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)


class AioCallsWithMetadata:
    """A grpc.aio stub whose every call carries a service token and the pairs `metadata()`
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
