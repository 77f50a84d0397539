"""A round-robin load balancer in front of several gateways, as users put one: per connection (a
TCP proxy: each client connection goes to the next gateway) or per request (HTTP/1.1: each
request on a keep-alive connection goes to the next gateway, on a keep-alive connection of the
balancer's own to it). For the tests that check that results reach a client through any gateway
(tests/e2e/test_balanced_gateways.py, tests/e2e/test_multi_host.py).

    python -m harness.balancer --mode connection|request --port P http://127.0.0.1:A http://127.0.0.1:B

prints `READY balancer <port>` once listening. With `--health-path /healthz` it checks each
backend there every `--health-every-s` and sends nothing to one whose check fails (not a 200, or
no answer within `--health-timeout-s`) until a check passes again, as a load balancer's or
Kubernetes' readiness probe does; each change is printed (`backend URL down: ...`, `backend URL
up`) and GET /_balancer/health answers each backend's state. A backend marked down has its
requests in flight answered 502 and its connections closed (HAProxy's `on-marked-down
shutdown-sessions`): a client waiting on a backend that went silent retries on another at once,
instead of after its own timeout. With no backend up, a request is answered 503 and a connection
closed.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import socket
import time
import urllib.parse

import httpx

# Not sent on to a backend: the balancer's own connection's, and the body's framing (set anew).
# (`expect`: the balancer has the whole body already; a backend's 100 Continue would be a reply
# of its own on the connection.)
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection",
               "content-length", "expect"}
# Not sent back to a client: its connection's (a reply's body goes on as it came, framing and all).
_HOP_ONLY = {"connection", "keep-alive", "proxy-connection"}


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


class Backends:
    """The backends in turn, skipping those whose last health check failed."""

    def __init__(self, urls: list[str], health_path: str = "", every_s: float = 1.0, timeout_s: float = 2.0):
        self.urls, self.health_path, self.every_s, self.timeout_s = urls, health_path, every_s, timeout_s
        self.watching: asyncio.Task | None = None
        self.in_flight: dict[str, set[asyncio.Future]] = {url: set() for url in urls}
        self.state = {url: {"up": True, "since": time.time(), "last": ""} for url in urls}
        self._turns = itertools.cycle(urls)

    def next(self) -> str | None:
        """The next backend that is up, or None when none is."""
        for _ in range(len(self.urls)):
            url = next(self._turns)
            if self.state[url]["up"]:
                return url
        return None

    async def watch(self) -> None:
        async with httpx.AsyncClient(timeout=self.timeout_s) as client:
            while True:
                await asyncio.gather(*(self._check(client, url) for url in self.urls))
                await asyncio.sleep(self.every_s)

    async def _check(self, client: httpx.AsyncClient, url: str) -> None:
        try:
            reply = await client.get(url + self.health_path)
            up, last = reply.status_code == 200, f"{reply.status_code} {reply.text[:200]}"
        except httpx.HTTPError as e:
            up, last = False, f"{type(e).__name__}: {e}"
        self.state[url]["last"] = last
        if up != self.state[url]["up"]:
            self.state[url].update(up=up, since=time.time())
            print(f"backend {url} {'up' if up else 'down: ' + last}", flush=True)
            if not up:
                for work in self.in_flight[url]:
                    work.cancel()

    async def run(self, url: str, work) -> asyncio.Future:
        """`work` (a coroutine) to `url`, ended if `url` is marked down meanwhile; returns it done."""
        if not self.health_path:       # nothing marks a backend down: awaited here, no task of its own
            future = asyncio.get_running_loop().create_future()
            try:
                future.set_result(await work)
            except Exception as e:  # noqa: BLE001 - the caller reads it off the future
                future.set_exception(e)
            return future
        future = asyncio.ensure_future(work)
        self.in_flight[url].add(future)
        try:
            await asyncio.wait({future})
        finally:
            self.in_flight[url].discard(future)
        return future


def per_connection(backends: Backends):
    async def serve(client_reader, client_writer):
        url = backends.next()
        if url is None:
            client_writer.close()
            return
        parts = urllib.parse.urlsplit(url)
        host, port = parts.hostname, parts.port
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(host, port)
        except OSError:
            client_writer.close()
            return
        await backends.run(url, asyncio.gather(_pipe(client_reader, upstream_writer),
                                               _pipe(upstream_reader, client_writer)))
        upstream_writer.close()
        client_writer.close()
    return serve


def _reply(writer: asyncio.StreamWriter, status: str, body: dict) -> None:
    data = json.dumps(body).encode()
    writer.write(f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n"
                 .encode() + data)


def _headers(head: bytes) -> tuple[str, list[tuple[str, str]]]:
    """A message head's first line and its headers."""
    first, *lines = head.decode("latin-1").rstrip("\r\n").split("\r\n")
    pairs = [line.split(":", 1) for line in lines if line]
    return first, [(k.strip(), v.strip()) for k, v in pairs]


def _value(headers: list[tuple[str, str]], name: str) -> str:
    return next((v for k, v in headers if k.lower() == name), "")


async def _chunked(reader: asyncio.StreamReader) -> bytes:
    """A chunked body as it came, its last chunk and trailers included (sent on as it is)."""
    parts = []
    while True:
        line = await reader.readuntil(b"\r\n")
        parts.append(line)
        size = int(line.split(b";", 1)[0].strip(), 16)
        if size == 0:
            while (trailer := await reader.readuntil(b"\r\n")) != b"\r\n":
                parts.append(trailer)
            parts.append(trailer)
            return b"".join(parts)
        parts.append(await reader.readexactly(size + 2))


async def _body(reader: asyncio.StreamReader, headers: list[tuple[str, str]]) -> bytes:
    if "chunked" in _value(headers, "transfer-encoding").lower():
        return await _chunked(reader)
    length = _value(headers, "content-length")
    return await reader.readexactly(int(length)) if length else b""


class _Unanswered(Exception):
    """A kept connection ended before any of its reply came."""


class Upstreams:
    """Keep-alive connections to each backend, reused request after request (as HAProxy's or
    nginx's upstream pools are): a request costs the balancer a parse and two writes, no client
    library and no new connection."""

    def __init__(self):
        self.idle: dict[str, list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = collections.defaultdict(list)

    async def exchange(self, url: str, method: str, request: bytes) -> tuple[str, list[tuple[str, str]], bytes]:
        """`request` (head and body) to `url`: the reply's status line, headers and body as it came."""
        idle = self.idle[url]
        while idle:
            reader, writer = idle.pop()
            if reader.at_eof() or writer.is_closing():      # the backend closed it while idle
                writer.close()
                continue
            try:
                return await self._on(url, reader, writer, method, request)
            except _Unanswered:
                pass            # closed by the backend as the request went (its idle timeout): again
        parts = urllib.parse.urlsplit(url)
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        return await self._on(url, reader, writer, method, request)

    async def _on(self, url, reader, writer, method, request):
        """One exchange on a connection; _Unanswered where the connection ended before a byte of
        the reply came (the only case in which sending the request again is safe: a backend
        closing an idle connection does so between requests, never after reading one)."""
        try:
            writer.write(request)
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError as e:
                if e.partial:
                    raise
                raise _Unanswered() from e
            except (ConnectionResetError, BrokenPipeError) as e:
                raise _Unanswered() from e
            while True:
                first, headers = _headers(head)
                status = int(first.split(" ", 2)[1])
                if not 100 <= status < 200 or status == 101:
                    break
                head = await reader.readuntil(b"\r\n\r\n")      # an interim reply (100 Continue): skipped
            keep = _value(headers, "connection").lower() != "close"
            if method == "HEAD" or status in (204, 304) or status < 200:
                body = b""
            elif "chunked" in _value(headers, "transfer-encoding").lower() or _value(headers, "content-length"):
                body = await _body(reader, headers)
            else:                               # delimited by the connection's end
                body, keep = await reader.read(), False
                headers.append(("content-length", str(len(body))))
        except BaseException:
            writer.close()                      # mid-exchange (failed, or its backend marked down)
            raise
        if keep:
            self.idle[url].append((reader, writer))
        else:
            writer.close()
        return first, headers, body


def per_request(backends: Backends):
    """Also answers GET /_balancer/stats itself (requests sent to each backend, by path) and GET
    /_balancer/health (each backend's state)."""
    upstreams = Upstreams()
    sent: dict[str, collections.Counter] = {url: collections.Counter() for url in backends.urls}

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                first, headers = _headers(head)
                method, target, _ = first.split(" ", 2)
                body = await _body(reader, headers)
                if target in ("/_balancer/stats", "/_balancer/health"):
                    _reply(writer, "200 OK", sent if target.endswith("stats") else backends.state)
                    await writer.drain()
                    continue
                url = backends.next()
                if url is None:
                    _reply(writer, "503 Service Unavailable", {"detail": "no backend is up"})
                    await writer.drain()
                    continue
                sent[url][target] += 1
                host = urllib.parse.urlsplit(url).netloc
                out = [f"{method} {target} HTTP/1.1", f"host: {host}"]
                out += [f"{k}: {v}" for k, v in headers if k.lower() not in _HOP_BY_HOP and k.lower() != "host"]
                chunked = "chunked" in _value(headers, "transfer-encoding").lower()
                out += ["transfer-encoding: chunked"] if chunked else [f"content-length: {len(body)}"]
                request = "\r\n".join([*out, "", ""]).encode("latin-1") + body
                call = await backends.run(url, upstreams.exchange(url, method, request))
                if call.cancelled() or call.exception() is not None:
                    why = "marked down" if call.cancelled() else f"{type(call.exception()).__name__}"
                    _reply(writer, "502 Bad Gateway", {"detail": f"the backend failed ({why})"})
                    await writer.drain()
                    continue
                status, reply_headers, content = call.result()
                out = [status, *(f"{k}: {v}" for k, v in reply_headers if k.lower() not in _HOP_ONLY), "", ""]
                writer.write("\r\n".join(out).encode("latin-1") + content)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()
    return serve


async def main(mode: str, port: int, backends: Backends) -> None:
    serve = per_connection(backends) if mode == "connection" else per_request(backends)
    if backends.health_path:
        backends.watching = asyncio.create_task(backends.watch())     # held: a task nothing holds may be collected
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
    parser.add_argument("--health-path", default="", help="checked on each backend (e.g. /healthz); none: no checks")
    parser.add_argument("--health-every-s", type=float, default=1.0)
    parser.add_argument("--health-timeout-s", type=float, default=2.0)
    parser.add_argument("backends", nargs="+")
    args = parser.parse_args()
    asyncio.run(main(args.mode, args.port, Backends(args.backends, args.health_path, args.health_every_s,
                                                    args.health_timeout_s)))
