"""`tinkerd gateway`: the Tinker REST gateway in its own process."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-model", required=True, help="local directory of the base model (also its tokenizer)")
    p.add_argument("--alias", action="append", default=[], help="another accepted name for the base model")
    p.add_argument("--trainer", required=True, help="trainer gRPC address host:port")
    p.add_argument("--sampler", action="append", required=True, help="sampler gRPC address (repeat per replica)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (0 picks a free one)")
    p.add_argument("--state-dir", default="./state")
    p.add_argument("--db-url", default=None, help="SQLAlchemy URL; default sqlite:///<state-dir>/tinkerd.db")
    p.add_argument("--session-timeout-s", type=float, default=600.0,
                   help="unload the models of sessions without a heartbeat for this long")
    p.add_argument("--max-pending-samples", type=int, default=4096,
                   help="sample requests in flight beyond this get HTTP 429 (the SDK backs off and resends)")


def main(args: argparse.Namespace) -> None:
    import asyncio
    import os
    import socket

    import uvicorn

    from gateway.app import GatewaySettings, create_app
    from tinkerd.process import init_logging

    init_logging("gateway")
    settings = GatewaySettings(base_model=os.path.abspath(args.base_model), trainer=args.trainer,
                               samplers=args.sampler, state_dir=os.path.abspath(args.state_dir),
                               aliases=args.alias, db_url=args.db_url, session_timeout_s=args.session_timeout_s,
                               max_pending_samples=args.max_pending_samples)
    app = create_app(settings)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit this. Without it a response written as headers + body waits
    # for the client's delayed ACK: 40 ms added to every call on a kept-alive connection.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((args.host, args.port))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", timeout_keep_alive=75)
    server = uvicorn.Server(config)

    async def serve():
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.02)
        print(f"READY gateway {port}", flush=True)
        await task
    asyncio.run(serve())
