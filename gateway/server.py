"""`tinkerd gateway`: the Tinker REST gateway in its own process."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket

from gateway.settings import GatewaySettings


def _listening_socket(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit this. Without it a response written as headers + body waits
    # for the client's delayed ACK: 40 ms added to every call on a kept-alive connection.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    return sock


def serve(settings: GatewaySettings) -> None:
    import uvicorn

    from gateway.app import create_app
    from gateway.http_limits import uvicorn_options
    from tinkerd.process import init_logging

    init_logging("gateway")
    settings = dataclasses.replace(settings, base_model=os.path.abspath(settings.base_model),
                                   state_dir=os.path.abspath(settings.state_dir))
    app = create_app(settings)
    sock = _listening_socket(settings.host, settings.port)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", **uvicorn_options(settings)))

    async def serve():
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.02)
        print(f"READY gateway {sock.getsockname()[1]}", flush=True)
        await task
    asyncio.run(serve())
