"""The gateway's connection limits (gateway/http_limits.py, issue 24 L3) on a real uvicorn server
built as `tinkerd gateway` builds it (`uvicorn_options` of the settings): requests beyond
--max-connections get 503 at once, a request head sent too slowly is cut off after
--header-timeout-s, and an idle kept-alive connection is closed after --keep-alive-timeout-s."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import uvicorn

from gateway.http_limits import uvicorn_options
from gateway.settings import GatewaySettings


async def _slow_app(scope, receive, send):
    """Answers after `?s` seconds (a long-poll, say)."""
    if scope["type"] != "http":
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
