"""harness/balancer.py per request, in front of two real uvicorn servers: each request goes to the
next backend over a connection the balancer keeps, and a reply reaches the client as the backend
sent it (chunked bodies, content-encoding, HEAD, a backend that closes its connection)."""

from __future__ import annotations

import gzip
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse

from launcher.up import free_port


def _backend(name: str) -> FastAPI:
    app = FastAPI()

    @app.api_route("/who", methods=["GET", "HEAD"])
    async def who(request: Request):
        return {"backend": name, "port": request.client.port}

    @app.post("/echo")
    async def echo(request: Request):
        body = await request.body()
        return {"backend": name, "bytes": len(body), "encoding": request.headers.get("content-encoding", ""),
                "host": request.headers["host"]}

    @app.get("/stream")
    async def stream():
        async def parts():
            for i in range(3):
                yield f"part {i};".encode()
        return StreamingResponse(parts(), media_type="text/plain")

    @app.get("/gzip")
    async def zipped():
        return Response(gzip.compress(b"x" * 1000), headers={"content-encoding": "gzip"}, media_type="text/plain")

    @app.get("/close")
    async def close():
        return Response(b"bye", headers={"connection": "close"})
    return app


@pytest.fixture(scope="module")
def balanced():
    servers, urls = [], []
    for name in ("a", "b"):
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(_backend(name), host="127.0.0.1", port=port, log_level="warning"))
        threading.Thread(target=server.run, daemon=True).start()
        servers.append(server)
        urls.append(f"http://127.0.0.1:{port}")
    for url in urls:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, f"{url} never listened"
                time.sleep(0.05)
    balancer = subprocess.Popen([sys.executable, "-m", "harness.balancer", "--mode", "request", *urls],
                                stdout=subprocess.PIPE, text=True)
    try:
        line = balancer.stdout.readline()
        assert line.startswith("READY balancer "), line
        yield f"http://127.0.0.1:{line.split()[-1]}", urls
    finally:
        balancer.kill()
        balancer.wait()
        for server in servers:
            server.should_exit = True


def test_each_request_goes_to_the_next_backend_over_a_kept_connection(balanced):
    url, backends = balanced
    with httpx.Client(base_url=url) as client:
        replies = [client.get("/who").json() for _ in range(10)]
    assert [r["backend"] for r in replies] == ["a", "b"] * 5
    # The balancer's own connection to each backend, reused: one client port per backend.
    assert {r["backend"]: {x["port"] for x in replies if x["backend"] == r["backend"]} for r in replies} \
        == {"a": {replies[0]["port"]}, "b": {replies[1]["port"]}}
    stats = httpx.get(url + "/_balancer/stats").json()
    assert stats[backends[0]]["/who"] == stats[backends[1]]["/who"] == 5


def test_bodies_and_their_framing_reach_each_side_as_sent(balanced):
    url, backends = balanced
    with httpx.Client(base_url=url) as client:
        body = gzip.compress(b"y" * 5000)
        for _ in range(2):          # once on each backend
            echo = client.post("/echo", content=body, headers={"content-encoding": "gzip"}).json()
            assert (echo["bytes"], echo["encoding"]) == (len(body), "gzip")
            assert echo["host"] == backends[0 if echo["backend"] == "a" else 1].split("//")[1]
        streamed = client.get("/stream")
        assert streamed.headers["transfer-encoding"] == "chunked" and streamed.text == "part 0;part 1;part 2;"
        zipped = client.get("/gzip")
        assert zipped.headers["content-encoding"] == "gzip" and zipped.text == "x" * 1000
        head = client.head("/who")
        assert head.status_code == 200 and head.content == b"" and int(head.headers["content-length"]) > 0
        # A backend closing its connection after a reply: the next requests still go through.
        assert [client.get("/close").text for _ in range(4)] == ["bye"] * 4
        assert {client.get("/who").json()["backend"] for _ in range(2)} == {"a", "b"}


def test_a_client_expecting_100_continue_gets_the_reply_and_the_kept_connection_stays_in_step(balanced):
    """`Expect: 100-continue` is not sent on (the balancer has the whole body): a backend's
    interim 100 would otherwise be taken for the reply, and the real one read by the next
    request on that kept connection."""
    url, _ = balanced
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        body = b'{"x": 1}'
        for i in range(4):
            s.sendall(b"POST /echo HTTP/1.1\r\nhost: b\r\ncontent-type: application/json\r\nexpect: 100-continue\r\n"
                      b"content-length: %d\r\n\r\n" % len(body) + body)
            reply = b""
            while b"\r\n\r\n" not in reply:
                reply += s.recv(65536)
            head, _, rest = reply.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200"), head
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            while len(rest) < length:
                rest += s.recv(65536)
            assert b'"bytes":8' in rest.replace(b" ", b""), rest
    with httpx.Client(base_url=url) as client:          # the kept connections still answer in step
        assert {client.get("/who").json()["backend"] for _ in range(4)} == {"a", "b"}
