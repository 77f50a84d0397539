"""The physical floor of each hop a request takes, measured on this machine in the same run as
the requests themselves (bench/request_costs.py): an HTTP request served by uvicorn (httptools,
as the gateway is served) to a bare ASGI app and to one FastAPI route with a pydantic body, from
httpx (the SDK's client); a SQLite WAL commit with the gateway's pragmas; a PostgreSQL commit
(pgserver, where installed); a journal append as the trainer writes one. gRPC's floor needs the
stack's trainer: request_costs measures it. Beside the SQLite floor, ours: a future's two
transactions as the gateway's store writes them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import socket
import sqlite3
import subprocess
import sys
import time

import psutil

from bench.common import cpu_seconds

_SERVER = r'''
import sys, uvicorn
kind, port = sys.argv[1], int(sys.argv[2])

async def bare(scope, receive, send):
    if scope["type"] != "http":
        return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b'{"request_id":"0","type":"x"}'})

if kind == "bare":
    app = bare
else:
    from fastapi import FastAPI
    from pydantic import BaseModel

    class Body(BaseModel):
        model_id: str
        seq_id: int
        data: list = []

    app = FastAPI()

    @app.post("/api/v1/x")
    async def x(body: Body) -> dict:
        return {"request_id": "0", "type": "x"}

uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", http="httptools", loop="asyncio")
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(kind: str, n: int) -> dict[str, float]:
    """ms per request: the server's CPU, the client's (httpx) CPU, and the round trip; `kind` is
    "bare" (an ASGI app that answers) or "fastapi" (one route, a pydantic body)."""
    import httpx

    port = _free_port()
    server = subprocess.Popen([sys.executable, "-c", _SERVER, kind, str(port)])
    try:
        url = f"http://127.0.0.1:{port}/api/v1/x"
        body = json.dumps({"model_id": "m" * 36, "seq_id": 5, "data": [1, 2, 3]})
        headers = {"content-type": "application/json"}
        with httpx.Client() as client:
            deadline = time.monotonic() + 60
            while True:
                try:
                    client.post(url, content=body, headers=headers)
                    break
                except httpx.TransportError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
            for _ in range(max(10, n // 10)):
                client.post(url, content=body, headers=headers)
            proc, me = psutil.Process(server.pid), psutil.Process()
            s0, c0, t0 = cpu_seconds(proc), cpu_seconds(me), time.perf_counter()
            for _ in range(n):
                client.post(url, content=body, headers=headers)
            wall = time.perf_counter() - t0
            s1, c1 = cpu_seconds(proc), cpu_seconds(me)
    finally:
        server.terminate()
        server.wait()
    return {"server": 1e3 * (s1 - s0) / n, "client": 1e3 * (c1 - c0) / n, "wall": 1e3 * wall / n}


def sqlite_commit(directory: str, n: int) -> float:
    """ms of CPU per transaction of one insert, WAL and synchronous=NORMAL (the gateway's pragmas),
    with the sqlite3 module directly: no SQLAlchemy."""
    path = os.path.join(directory, "floor.sqlite")
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("CREATE TABLE IF NOT EXISTS t (id TEXT PRIMARY KEY, body BLOB)")
        me = psutil.Process()
        c0 = cpu_seconds(me)
        for i in range(n):
            conn.execute("BEGIN")
            conn.execute("INSERT INTO t VALUES (?, ?)", (f"r{i}", b"x" * 200))
            conn.execute("COMMIT")
        return 1e3 * (cpu_seconds(me) - c0) / n
    finally:
        conn.close()
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path + suffix)


def postgres_commit(directory: str, n: int) -> dict[str, float] | None:
    """ms per transaction of one insert on a local PostgreSQL (pgserver, unix socket; the test
    server's fsync off): the client's CPU and the round trip. None where pgserver is missing."""
    if importlib.util.find_spec("pgserver") is None or importlib.util.find_spec("psycopg") is None:
        return None
    import psycopg

    from harness.postgres import postgres

    with postgres(os.path.join(directory, "floor-pg"), "floor") as url:
        conninfo = url.replace("postgresql+psycopg://", "postgresql://")
        with psycopg.connect(conninfo) as conn:
            conn.execute("CREATE TABLE t (id TEXT PRIMARY KEY, body BYTEA)")
            conn.commit()
            me = psutil.Process()
            c0, t0 = cpu_seconds(me), time.perf_counter()
            for i in range(n):
                conn.execute("INSERT INTO t VALUES (%s, %s)", (f"r{i}", b"x" * 200))
                conn.commit()
            wall = time.perf_counter() - t0
            return {"client": 1e3 * (cpu_seconds(me) - c0) / n, "wall": 1e3 * wall / n}


def journal_append(directory: str, n: int) -> float:
    """ms per line appended as the trainer's journal does (trainer_service/durable.py: open, write,
    close; no fsync)."""
    path = os.path.join(directory, "floor.journal")
    line = json.dumps({"seq": 1, "kind": "forward_backward", "reply": "x" * 64}) + "\n"
    t0 = time.perf_counter()
    for _ in range(n):
        with open(path, "a") as f:
            f.write(line)
    wall = time.perf_counter() - t0
    os.remove(path)
    return 1e3 * wall / n


def future_transactions(directory: str, n: int) -> float:
    """Ours beside sqlite_commit's floor: ms of CPU per future for its two transactions as the
    gateway writes them (gateway/futures/store.py FutureStore: the pending row inserted, then
    finished with its result), on SQLite with the gateway's pragmas, in this thread."""
    from gateway.futures.store import FutureStore, new_request_id
    from gateway.storage.db import Database, FutureRow, Status

    path = os.path.join(directory, "ours.sqlite")
    store = FutureStore(Database(f"sqlite:///{path}"))
    try:
        me = psutil.Process()
        c0 = cpu_seconds(me)
        for _ in range(n):
            row = store.insert(FutureRow(request_id=new_request_id(), fingerprint="f" * 64, owner="u",
                                         request_type="sample", extra={}, request_args={"a": 1},
                                         request_body=b"x" * 200, claimed_by="bench"))
            store.finish(row.request_id, Status.COMPLETE, "application/x-protobuf", b"y" * 200)
        return 1e3 * (cpu_seconds(me) - c0) / n
    finally:
        store.db.engine.dispose()
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path + suffix)
