"""The gateway's connection limits (gateway/http_limits.py, issue 24 L3) on a real uvicorn server
built as `tinkerd gateway` builds it (`uvicorn_options` of the settings): requests beyond
--max-connections get 503 at once, a request head sent too slowly is cut off after
--header-timeout-s, and an idle kept-alive connection is closed after --keep-alive-timeout-s.
And its writes: a response is one send, an interim 100 Continue is not held back, a large
streamed body and a response before a close arrive whole."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import uvicorn

from gateway.http_limits import uvicorn_options
from gateway.settings import GatewaySettings


STREAMED = [bytes([65 + i]) * 50_000 for i in range(8)]     # 400 kB in chunks after the head


async def _slow_app(scope, receive, send):
    """Answers after `?s` seconds (a long-poll, say); /echo answers the request's body, /stream
    streams STREAMED."""
    if scope["type"] != "http":
        return
    if scope["path"] == "/echo":
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})
        return
    if scope["path"] == "/stream":
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"%d" % sum(map(len, STREAMED)))]})
        for chunk in STREAMED:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    if scope["path"] == "/peer":
        body = f"{scope['client'][0]} {scope['scheme']}".encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})
        return
    await asyncio.sleep(float(scope["query_string"].decode() or 0))
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def server():
    settings = GatewaySettings(base_model="/m", trainer="t:1", max_connections=3, header_timeout_s=0.5,
                               keep_alive_timeout_s=1)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(_slow_app, log_level="warning", lifespan="off", **uvicorn_options(settings))
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.01)
    try:
        yield sock.getsockname()[1]
    finally:
        srv.should_exit = True
        thread.join(10)


def _request(port: int, path: str = "/") -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", port), timeout=10)
    conn.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return conn


def _status(conn: socket.socket) -> int:
    return int(conn.recv(4096).split(b" ", 2)[1])


def _closed_after(conn: socket.socket) -> float:
    """Seconds until the server closes `conn` (reading and dropping what it sends)."""
    t0 = time.monotonic()
    while conn.recv(4096):
        pass
    return time.monotonic() - t0


def test_requests_beyond_max_connections_get_503_at_once(server):
    busy = [_request(server, "/?2") for _ in range(2)]        # two requests in progress
    time.sleep(0.3)
    t0 = time.monotonic()
    extra = _request(server)                                   # the third open connection: the limit
    assert _status(extra) == 503 and time.monotonic() - t0 < 1.0
    assert [_status(c) for c in busy] == [200, 200]
    for c in busy:
        c.close()
    time.sleep(0.2)
    assert _status(_request(server)) == 200                    # room again


def test_a_request_head_sent_too_slowly_is_cut_off(server):
    slow = socket.create_connection(("127.0.0.1", server), timeout=10)
    t0 = time.monotonic()
    try:
        for byte in b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
            slow.sendall(bytes([byte]))
            time.sleep(0.05)
    except (BrokenPipeError, ConnectionResetError):
        pass
    assert _closed_after(slow) + (time.monotonic() - t0) < 2.0   # 0.5 s, not the 5+ s the head takes
    silent = socket.create_connection(("127.0.0.1", server), timeout=10)   # connects, sends nothing
    assert 0.3 < _closed_after(silent) < 2.0


def test_a_slow_request_is_not_cut_off_and_idle_keep_alive_ends(server):
    conn = _request(server, "/?1")                             # runs past the header timeout
    assert _status(conn) == 200
    conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")         # kept alive: a second request
    assert _status(conn) == 200
    assert 0.7 < _closed_after(conn) < 2.5                     # then idle: closed after 1 s


class _Recording(asyncio.Transport):
    """The socket's side of a connection: what the protocol sends, one entry per system call."""

    def __init__(self):
        super().__init__()
        self.sent: list[bytes] = []
        self.closed = False

    def write(self, data):
        self.sent.append(bytes(data))

    def is_closing(self):
        return self.closed

    def close(self):
        self.closed = True

    def get_extra_info(self, name, default=None):
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(name, default)

    def pause_reading(self):
        pass

    def resume_reading(self):
        pass


def test_a_response_is_one_send():
    """uvicorn writes a response's head and its body apart: two sends, two TCP segments on the
    gateway's TCP_NODELAY socket, and two wake-ups of the client, for every request. Through the
    gateway's protocol (the real uvicorn one, only the socket recorded) each response is one."""
    settings = GatewaySettings(base_model="/m", trainer="t:1")
    config = uvicorn.Config(_slow_app, log_level="warning", lifespan="off", **uvicorn_options(settings))
    config.load()

    async def exchange():
        protocol = config.http_protocol_class(config=config, server_state=uvicorn.server.ServerState(),
                                              app_state={})
        transport = _Recording()
        protocol.connection_made(transport)
        for body in (b"hello", b"again"):       # two requests on one kept-alive connection
            protocol.data_received(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n" + body)
            for _ in range(20):
                await asyncio.sleep(0)
        protocol.connection_lost(None)
        return transport.sent

    sent = asyncio.run(exchange())
    assert len(sent) == 2, sent
    for data, body in zip(sent, (b"hello", b"again")):
        assert data.startswith(b"HTTP/1.1 200 OK\r\n") and data.endswith(b"\r\n\r\n" + body), data


def _response(conn: socket.socket) -> tuple[bytes, bytes]:
    """(head, body) of one response with a content-length."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        chunk = conn.recv(65536)
        assert chunk, "closed before the body was whole"
        body += chunk
    return head, body


def test_a_held_head_keeps_interim_responses_streams_and_closes_whole(server):
    # An interim 100 Continue goes out while the server waits for the body (curl sends
    # Expect: 100-continue for bodies over 1 KiB and waits a second for it).
    conn = socket.create_connection(("127.0.0.1", server), timeout=10)
    conn.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 4\r\n\r\n")
    conn.settimeout(0.5)
    assert conn.recv(4096).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
    conn.settimeout(10)
    conn.sendall(b"body")
    assert _response(conn)[1] == b"body"
    # A streamed body over what one turn holds arrives whole and in order.
    conn.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
    assert _response(conn)[1] == b"".join(STREAMED)
    # A response the server closes the connection after (the client asked it to) arrives whole.
    conn.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 3\r\n\r\nend")
    assert _response(conn)[1] == b"end"
    assert conn.recv(4096) == b""


def test_the_open_files_limit_is_raised_to_fit_max_connections():
    """A soft limit of 1,024 (common) would refuse connections far below --max-connections: the
    gateway raises it toward the hard limit, and says so where the hard limit is lower."""
    import subprocess
    import sys

    code = ("import logging, resource, sys; logging.basicConfig(stream=sys.stdout)\n"
            "from gateway.http_limits import fit_open_files, OTHER_FILES\n"
            "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (256, {hard}))\n"
            "print(fit_open_files(2000), resource.getrlimit(resource.RLIMIT_NOFILE)[0], 2000 + OTHER_FILES)\n")
    out = subprocess.run([sys.executable, "-c", code.format(hard="hard")], capture_output=True, text=True,
                         check=True).stdout.split()
    import resource
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    want = int(out[2])
    assert int(out[0]) == int(out[1]) == (want if hard == resource.RLIM_INFINITY else min(want, hard))
    # A hard limit below what --max-connections needs: raised to it, and said.
    cap = 512 if hard == resource.RLIM_INFINITY else min(512, hard)
    low = subprocess.run([sys.executable, "-c", code.format(hard=cap)], capture_output=True, text=True,
                         check=True).stdout
    assert low.split()[-3:-1] == [str(cap), str(cap)] and "raise it (ulimit -n" in low, low


def test_forwarding_headers_are_left_to_the_gateway(server):
    """uvicorn would take a loopback peer's X-Forwarded-For and -Proto as the client and scheme,
    whatever --trusted-proxy says (and a trusted proxy's peer address would then be the client's,
    so gateway/public_url.py would not trust it): the app sees the real peer and scheme."""
    conn = socket.create_connection(("127.0.0.1", server), timeout=10)
    conn.sendall(b"GET /peer HTTP/1.1\r\nHost: x\r\nX-Forwarded-For: 203.0.113.9\r\n"
                 b"X-Forwarded-Proto: https\r\n\r\n")
    answer = conn.recv(4096)
    conn.close()
    assert answer.endswith(b"\r\n\r\n127.0.0.1 http"), answer
