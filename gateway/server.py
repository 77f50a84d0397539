"""`tinkerd gateway`: the Tinker REST gateway in its own process: one app on two listeners
(gateway/listeners.py), the public one and the internal one, both HTTPS with --https-cert."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import os
import socket
import sys

from gateway import public_url
from gateway.settings import GatewaySettings


def _listening_socket(host: str, port: int, flags: str, reuse_port: bool = False) -> socket.socket:
    """Bound to (host, port), or SystemExit saying which flags to change (`flags`: the ones that set
    them) instead of a traceback in the gateway's log. `reuse_port`: shared with the other
    processes that bind it so (--reuse-port)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    # Accepted connections inherit this. Without it a response written as headers + body waits
    # for the client's delayed ACK: 40 ms added to every call on a kept-alive connection.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        fix = ("another process listens there: stop it, or pick another port (0: a free one)"
               if e.errno == errno.EADDRINUSE else "this host cannot listen there")
        raise SystemExit(f"tinkerd: cannot listen on {host}:{port} ({flags}): {e.strerror}; {fix}") from None
    return sock


def _check_certificate(cert: str, key: str) -> None:
    """Loaded as uvicorn will load them, before anything starts: a file that is no PEM certificate
    or key, or a key of another certificate, killed the gateway after the trainer and the samplers
    had started (an ssl traceback in its log)."""
    import ssl

    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as e:
        raise SystemExit(f"tinkerd: --https-cert {cert} with --https-key {key} cannot serve HTTPS "
                         f"({getattr(e, 'reason', None) or e}): a PEM certificate (its chain after it) and the "
                         f"PEM private key of that certificate, unencrypted") from None


def check_listeners(settings: GatewaySettings) -> None:
    """Refuses listener settings that cannot serve (before anything starts, not in a log later)."""
    if settings.port and settings.port == settings.internal_port:
        raise SystemExit(f"tinkerd: --port and --internal-port are both {settings.port}: the internal listener "
                         f"(/internal/, /metrics) needs a port of its own")
    for host, port, flags, shared in ((settings.host, settings.port, "--host/--port", settings.reuse_port),
                                      (settings.internal_host, settings.internal_port,
                                       "--internal-host/--internal-port", False)):
        if port:        # a fixed one: free now, not found taken once the trainer and samplers have started
            _listening_socket(host, port, flags, shared).close()
    if bool(settings.https_cert) != bool(settings.https_key):
        raise SystemExit("tinkerd: --https-cert and --https-key go together")
    for path in (settings.https_cert, settings.https_key):
        if path and not os.path.isfile(path):
            raise SystemExit(f"tinkerd: {path} (--https-cert/--https-key) is not a file")
    if settings.https_cert:
        _check_certificate(settings.https_cert, settings.https_key)
        from gateway.routes.service import rustls_accepts

        if not rustls_accepts(settings.https_cert):
            print(f"tinkerd: --https-cert {settings.https_cert} is a CA certificate (basicConstraints CA:TRUE), which "
                  f"the tinker SDK's default transport (pyqwest: rustls) refuses as a server's: its clients are told "
                  f"to use httpx instead, which costs them more CPU per request. Serve a leaf certificate (CA:FALSE) "
                  f"for the faster one.", file=sys.stderr, flush=True)
    problem = public_url.check(settings.public_url, settings.trusted_proxies)
    if problem:
        raise SystemExit(f"tinkerd: {problem}")


def serve(settings: GatewaySettings) -> None:
    import uvicorn

    from gateway.app import create_app
    from gateway.http_limits import fit_open_files, uvicorn_options
    from gateway.listeners import INTERNAL, Listener
    from tinkerd.process import freeze_heap, init_logging

    check_listeners(settings)
    init_logging("gateway")
    settings = dataclasses.replace(settings, base_model=os.path.abspath(settings.base_model),
                                   state_dir=os.path.abspath(settings.state_dir))
    app = create_app(settings)
    sock = _listening_socket(settings.host, settings.port, "--host/--port", settings.reuse_port)
    internal_sock = _listening_socket(settings.internal_host, settings.internal_port,
                                      "--internal-host/--internal-port")
    tls = {"ssl_certfile": settings.https_cert, "ssl_keyfile": settings.https_key} if settings.https else {}
    limits = uvicorn_options(settings)     # connection limit, keep-alive, header deadline: on both listeners
    fit_open_files(settings.max_connections)
    # An unstamped request is the public listener's: only the internal one wraps the app.
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", **limits, **tls))
    # The same app: its lifespan (backends, housekeeping) runs once, under the public server.
    internal = uvicorn.Server(uvicorn.Config(Listener(app, INTERNAL), log_level="warning", lifespan="off", **limits,
                                             **tls))

    async def serve():
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            if task.done():
                return await task
            await asyncio.sleep(0.02)
        internal_task = asyncio.create_task(internal.serve(sockets=[internal_sock]))
        while not internal.started:
            if internal_task.done():
                break
            await asyncio.sleep(0.02)
        freeze_heap()                     # started: what exists now lives as long as the gateway
        print(f"INTERNAL gateway {internal_sock.getsockname()[1]}", flush=True)
        print(f"READY gateway {sock.getsockname()[1]}", flush=True)
        # A signal reaches one server's handler only (each installs its own): stop both together.
        await asyncio.wait([task, internal_task], return_when=asyncio.FIRST_COMPLETED)
        server.should_exit = internal.should_exit = True
        await asyncio.gather(task, internal_task)
    event_loop(settings.event_loop)(serve())


def event_loop(choice: str):
    """How the gateway's loop runs (--event-loop): `auto`, uvloop's where installed (uvicorn's own
    choice: the loop's own work in C, less CPU per request, docs/benchmarks.md#request_costs),
    else asyncio's."""
    if choice == "auto":
        try:
            import uvloop
            return uvloop.run
        except ImportError:
            pass
    return asyncio.run
