"""Service-level calls: client configuration, health, capabilities, telemetry."""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import time

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sqlalchemy import text

from gateway.backends import token_mismatch
from gateway.state import GatewayDep
from tinkerd.rpc import ServiceAuth, aio_channel
from tinkerd.v1 import common_pb2, trainer_pb2_grpc

log = logging.getLogger(__name__)

router = APIRouter(prefix="/api/v1")

# What the SDK switches on or off: only transports and features this server implements.
# use_pyqwest_transport: the SDK's own default (reqwest/hyper, rustls) costs less client CPU per
# request than httpx (docs/benchmarks.md#request_costs), but only a client that can survive it gets
# it (`pyqwest_exits_cleanly`) and only where rustls can reach this gateway (`rustls_accepts`).
# With auth on, the SDK exchanges its API key for a JWT (routes/identity.py) and whoami works.
# sample_use_retrieve_futures (--sample-session-poll, off by default): SDK >= 0.28 polls one
# retrieve_futures per sampling session in place of one retrieve_future per sample
# (routes/futures.py); older SDKs ignore it.
# custom_loss_server_side: SDK >= 0.36 uploads create_custom_loss's traced loss and runs it here by
# its loss id in one forward_backward (routes/custom_losses.py, gateway/custom_losses.py).
# proto_compress_fwdbwd (--fwdbwd-compression): a client on this host is told not to compress.
CLIENT_CONFIG = {"parallel_fwdbwd_chunks": True,
                 "custom_loss_server_side": True, "sample_join_sampling_session": True}


@router.post("/client/config")
async def client_config(request: Request, gw: GatewayDep) -> dict:
    reaches = not gw.settings.https or rustls_accepts(gw.settings.https_cert)
    pyqwest = reaches and pyqwest_exits_cleanly(request.headers)
    return {**CLIENT_CONFIG, "pjwt_auth_enabled": gw.settings.auth, "use_pyqwest_transport": pyqwest,
            "sample_use_retrieve_futures": gw.settings.sample_session_poll,
            "proto_compress_fwdbwd": compresses(gw.settings.fwdbwd_compression, request)}


_FORWARDED = ("forwarded", "x-forwarded-for", "x-real-ip")


def compresses(setting: str, request: Request) -> bool:
    """Whether the SDK that sent `request` should compress forward_backward (--fwdbwd-compression).
    `auto`: unless it came from a loopback address without a proxy's forwarding header, which
    would mean a client elsewhere behind a proxy on this host."""
    if setting != "auto":
        return setting == "on"
    if request.client is None or any(header in request.headers for header in _FORWARDED):
        return True
    try:
        return not ipaddress.ip_address(request.client.host).is_loopback
    except ValueError:          # not an IP address (a unix socket's peer)
        return True


# CPython 3.14 parks a thread that wants the GIL once the interpreter is finalizing (gh-87135).
# Before it, such a thread is ended by pthread_exit, and a pyqwest (tokio) thread that hands the
# SDK's last response to its event loop as the script exits unwinds through Rust frames that
# cannot unwind: the client process aborts (exit 134) after its work is done, silently.
PYQWEST_SAFE_FROM = (3, 14)


def pyqwest_exits_cleanly(headers) -> bool:
    """Whether the SDK that sent `headers` (its Stainless platform headers name its interpreter)
    runs where pyqwest's threads cannot abort the process at exit: CPython 3.14 or later."""
    if headers.get("x-stainless-runtime") != "CPython":
        return False
    try:
        version = tuple(int(part) for part in headers.get("x-stainless-runtime-version", "").split(".")[:2])
    except ValueError:
        return False
    return version >= PYQWEST_SAFE_FROM


@functools.cache
def rustls_accepts(cert_path: str) -> bool:
    """Whether the SDK's default transport (pyqwest: rustls) accepts --https-cert as a server's
    certificate. rustls refuses a CA certificate in that place (CaUsedAsEndEntity) where OpenSSL,
    and so httpx, accepts it; `openssl req -x509` makes one unless told `basicConstraints=CA:FALSE`.
    Such a gateway sends its SDKs to httpx (and says so at start: gateway/server.py)."""
    from cryptography import x509

    with open(cert_path, "rb") as f:
        served = x509.load_pem_x509_certificate(f.read())      # the first of the chain: the server's own
    try:
        return not served.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        return True


# sample_cancel_enabled: SDK >= 0.26 sends cancel_future for a sample it abandons (routes/futures.py).
DYNAMIC_CONFIG = {"refresh_interval_sec": 300, "sample_cancel_enabled": True, "sample_cancel_max_batch_size": 64}


@router.post("/client/dynamic_config")
async def dynamic_config() -> dict:
    return DYNAMIC_CONFIG


@router.post("/telemetry")
async def telemetry() -> dict:
    return {"status": "accepted"}


@router.get("/healthz")
async def healthz(request: Request, gw: GatewayDep):
    """Public and cheap (a load balancer's or Kubernetes' readiness probe): ok when the database
    answers, the trainer reports SERVING and at least one sampler does (the others are listed as
    down but do not take the gateway out of service). The samplers' state is the pool's live set
    (gateway/sampler_pool.py checks each replica's grpc.health.v1 every second), not a second
    check. Says which part is down, never why: the reason is logged, not shown to anyone who can
    reach the port. The database and trainer checks are shared (`Probe`)."""
    probe = getattr(request.app.state, "healthz_probe", None)
    if probe is None:
        probe = request.app.state.healthz_probe = Probe()
    database, trainer = await probe.result(gw)
    pool = gw.backends.samplers
    live = len(pool.live())
    body = {"database": database, "trainer": trainer, "samplers": f"{live}/{len(pool.members)} ok"}
    if database == "ok" and trainer == "ok" and live:
        return {"status": "ok", **body}
    return JSONResponse({"status": "unavailable", **body}, status_code=503)


# Each part answers within this, or counts as down: a probe must not hang on a dead service.
_PROBE_TIMEOUT_S = 3.0
# healthz is public: answered from one probe for this long, a caller cannot make the gateway open
# a trainer channel (a TLS handshake under mTLS), ping the database and re-read the token and
# certificate files at whatever rate it sends.
CACHE_S = 1.0


class Probe:
    """The database's and the trainer's state, checked at most once per CACHE_S; callers that
    come while a check runs wait for that one."""

    def __init__(self):
        self.checks = 0
        self._result: tuple[str, str] | None = None
        self._at = 0.0
        self._running: asyncio.Task | None = None

    async def result(self, gw) -> tuple[str, str]:
        if self._result is not None and time.monotonic() - self._at < CACHE_S:
            return self._result
        if self._running is None:
            self._running = asyncio.create_task(self._check(gw))
        return await asyncio.shield(self._running)     # one caller leaving does not cancel the others' check

    async def _check(self, gw) -> tuple[str, str]:
        try:
            self.checks += 1
            auth = ServiceAuth.of(gw.settings)
            database, trainer = await asyncio.gather(_database(gw), _serving(gw.settings.trainer, auth))
            self._result, self._at = (database, trainer), time.monotonic()
            return self._result
        finally:
            self._running = None


async def _database(gw) -> str:
    def ping():
        with gw.db.engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    try:
        await asyncio.wait_for(asyncio.to_thread(ping), _PROBE_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - any failure means unreachable; the reason goes to the log
        log.warning("healthz: database unreachable: %s: %s", type(e).__name__, e)
        return "unreachable"
    return "ok"


async def _serving(address: str, auth: ServiceAuth) -> str:
    """The service's grpc.health.v1 status, on a channel of its own: the backends' channels wait
    for a restarting service, a probe must not. A new connection per probe is cheap at probe rates."""
    try:
        async with aio_channel(address, auth) as ch:
            reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                              timeout=_PROBE_TIMEOUT_S)
            if reply.status == health_pb2.HealthCheckResponse.SERVING and not await _takes_token(ch, address, auth):
                return "not serving"
    except grpc.aio.AioRpcError as e:
        log.warning("healthz: %s does not answer: %s: %s", address, e.code().name, e.details())
        return "unreachable"
    return "ok" if reply.status == health_pb2.HealthCheckResponse.SERVING else "not serving"


async def _takes_token(ch, address: str, auth: ServiceAuth) -> bool:
    """Whether the trainer takes this gateway's service token: its health check is open to all,
    and a token it refuses fails every other call."""
    if not auth.holds_token:
        return True
    try:
        await trainer_pb2_grpc.TrainerStub(ch).Health(common_pb2.HealthRequest(), timeout=_PROBE_TIMEOUT_S)
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.UNAUTHENTICATED:
            log.error("healthz: %s", token_mismatch(address, e.details()))
            return False
    return True


@router.get("/get_server_capabilities")
async def capabilities(gw: GatewayDep) -> dict:
    return {"supported_models": [{"model_name": name, "trainable": True, "sampleable": True}
                                 for name in gw.settings.model_names]}
