"""A round-robin load balancer in front of several gateways, as users put one: per connection (a
TCP proxy: each client connection goes to the next gateway) or per request (HTTP/1.1: each
request on a keep-alive connection goes to the next gateway). For the tests that check that
results reach a client through any gateway (tests/e2e/test_balanced_gateways.py).

    python -m harness.balancer --mode connection|request --port P http://127.0.0.1:A http://127.0.0.1:B

prints `READY balancer <port>` once listening.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import socket
import urllib.parse

import httpx

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection",
               "content-length", "content-encoding"}


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


def per_connection(backends: list[str]):
    addresses = itertools.cycle([(u.hostname, u.port) for u in map(urllib.parse.urlsplit, backends)])

    async def serve(client_reader, client_writer):
        host, port = next(addresses)
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(host, port)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(_pipe(client_reader, upstream_writer), _pipe(upstream_reader, client_writer))
    return serve


def per_request(backends: list[str]):
    """Also answers GET /_balancer/stats itself: requests sent to each backend, by path."""
    urls = itertools.cycle(backends)
    client = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None))
    sent: dict[str, collections.Counter] = {url: collections.Counter() for url in backends}

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = [tuple(line.split(":", 1)) for line in lines[1:] if line]
                headers = [(k.strip(), v.strip()) for k, v in headers]
                length = next((int(v) for k, v in headers if k.lower() == "content-length"), 0)
                body = await reader.readexactly(length) if length else b""
                if target == "/_balancer/stats":
                    stats = json.dumps(sent).encode()
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                                 + str(len(stats)).encode() + b"\r\n\r\n" + stats)
                    await writer.drain()
                    continue
                url = next(urls)
                sent[url][target] += 1
                forwarded = [(k, v) for k, v in headers if k.lower() not in _HOP_BY_HOP and k.lower() != "host"]
                if any(k.lower() == "content-encoding" for k, _ in headers):
                    forwarded += [(k, v) for k, v in headers if k.lower() == "content-encoding"]
                reply = await client.request(method, url + target, headers=forwarded, content=body)
                content = reply.content       # decoded: sent on without its content-encoding
                out = [f"HTTP/1.1 {reply.status_code} {reply.reason_phrase}"]
                out += [f"{k}: {v}" for k, v in reply.headers.multi_items() if k.lower() not in _HOP_BY_HOP]
                out += [f"content-length: {len(content)}", "", ""]
                writer.write("\r\n".join(out).encode("latin-1") + content)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()
    return serve


async def main(mode: str, port: int, backends: list[str]) -> None:
    serve = per_connection(backends) if mode == "connection" else per_request(backends)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    server = await asyncio.start_server(serve, sock=sock)
    print(f"READY balancer {sock.getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("connection", "request"), required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("backends", nargs="+")
    args = parser.parse_args()
    asyncio.run(main(args.mode, args.port, args.backends))
