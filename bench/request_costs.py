"""The stack's fixed cost per request, by kind, on the tiny model (where the engines take little and
our own work shows, as on a GPU): the CPU the gateway, the trainer's process and the SDK's client
spend per request, its wall time through the SDK, and the HTTP requests the SDK makes for it, for
forward_backward, optim_step, a one-token sample (one at a time, and 16 at once), and
save_weights_for_sampler (each waited for before the next: the fixed cost, not throughput).

Beside them, the floor of each hop measured in the same run (bench/floors.py: an HTTP request to a
bare ASGI app and to a FastAPI route under uvicorn, a SQLite WAL commit, a PostgreSQL commit, a
journal append; here a gRPC unary call to the trainer), and each kind's gateway floor: its HTTP
requests to a bare ASGI app, one gRPC call, and the two commits every future needs (its row, its
finish).
"""

from __future__ import annotations

import collections
import os
import re
import time

import httpx
import psutil

from bench import floors
from bench.common import Context, Row, cpu_seconds, tinkerd_up
from harness.stack import service_pids

TARGET_MS = {"sample": 1.0}          # gateway CPU per request; training requests 2 ms (issue: fixed costs)
BURST = 16                           # samples at once in the burst kind
# Not part of a request: the stack's own traffic during the measurement.
_BACKGROUND = ("/metrics", "/api/v1/healthz", "/internal/v1/samplers/register", "/api/v1/session_heartbeat")


def _requests(stack) -> collections.Counter:
    """The gateway's HTTP requests answered so far, by route template (its /metrics)."""
    text = httpx.get(f"{stack.internal_url}/metrics", headers={"X-API-Key": stack.api_key}).text
    counts = collections.Counter()
    for labels, value in re.findall(r"^tinkerd_gateway_requests_total\{(.*)\} (\S+)$", text, re.M):
        route = dict(re.findall(r'(\w+)="([^"]*)"', labels))["route"]
        if route not in _BACKGROUND:
            counts[route] += float(value)
    return counts


def _measure(fn, n: int, per_call: int, processes: dict[str, psutil.Process], stack) -> dict:
    """Per request (`fn` makes `per_call` of them), in ms: each process's CPU, and the wall time;
    and the HTTP requests the SDK made for one, by route."""
    fn()                                     # warm
    time.sleep(0.2)                          # the SDK's acknowledgements of the warm-up answered
    http0 = _requests(stack)
    before = {name: cpu_seconds(p) for name, p in processes.items()}
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    wall = time.perf_counter() - t0
    out = {name: 1e3 * (cpu_seconds(p) - before[name]) / (n * per_call) for name, p in processes.items()}
    time.sleep(0.2)
    http = _requests(stack) - http0
    out["wall"] = 1e3 * wall / (n * per_call)
    out["http"] = {route.rsplit("/", 1)[-1]: count / (n * per_call) for route, count in http.items()}
    return out


def _alone(stack, gateway: psutil.Process, model_id: str, sampling_session_id: str, n: int) -> dict[str, float]:
    """Ms of gateway CPU for one request with nothing waiting on it (httpx, kept alive): the edge's
    direct calls (retrieve_future of a finished future: a no-op's, POST /internal/noop_future; an
    acknowledgement-only retrieve_futures poll, as SDK 0.38 sends two a lone sample: timeout 0,
    the session's current cursor) and a FastAPI route with a body model (get_info)."""
    with httpx.Client(headers={"X-API-Key": stack.api_key}, timeout=30) as client:
        request_id = client.post(f"{stack.internal_url}/internal/noop_future").json()["request_id"]
        poll = {"target": {"type": "sampling_session", "sampling_session_id": sampling_session_id,
                           "cloned_sampler_id": 0}, "prev_cursor": 0, "timeout": 0}
        poll["prev_cursor"] = client.post(f"{stack.url}/api/v1/retrieve_futures", json=poll).json()["cursor"]
        calls = {"retrieve_future of a finished future (a direct route)":
                 lambda: client.post(f"{stack.url}/api/v1/retrieve_future", json={"request_id": request_id}),
                 "retrieve_futures, an acknowledgement-only poll (a direct route)":
                 lambda: client.post(f"{stack.url}/api/v1/retrieve_futures", json=poll),
                 "get_info (a FastAPI route)":
                 lambda: client.post(f"{stack.url}/api/v1/get_info", json={"model_id": model_id})}
        out = {}
        for name, call in calls.items():
            assert call().status_code == 200
            c0 = cpu_seconds(gateway)
            for _ in range(n):
                call()
            out[name] = 1e3 * (cpu_seconds(gateway) - c0) / n
    return out


def _grpc_floor(stack, n: int) -> dict[str, float]:
    """One trainer Health call over gRPC from this process: a unary round trip's floor (ms of wall,
    and of this process's CPU); and the client's CPU for the same call through grpc.aio on an
    event loop, as the gateway makes it ("aio")."""
    import asyncio

    from tinkerd.rpc import ServiceAuth, aio_channel, channel
    from tinkerd.v1 import common_pb2, trainer_pb2_grpc

    with open(os.path.join(stack.state_dir, "service-token")) as f:
        auth = ServiceAuth(token=f.read().strip())
    with open(f"{stack.state_dir}/logs/trainer.log", "rb") as f:
        port = int(re.search(rb"READY trainer (\d+)", f.read()).group(1))
    stub = trainer_pb2_grpc.TrainerStub(channel(f"127.0.0.1:{port}", auth))
    stub.Health(common_pb2.HealthRequest())
    me = psutil.Process()
    c0, t0 = cpu_seconds(me), time.perf_counter()
    for _ in range(n):
        stub.Health(common_pb2.HealthRequest())
    out = {"wall": 1e3 * (time.perf_counter() - t0) / n, "client": 1e3 * (cpu_seconds(me) - c0) / n}

    async def through_aio() -> float:
        aio = trainer_pb2_grpc.TrainerStub(aio_channel(f"127.0.0.1:{port}", auth))
        await aio.Health(common_pb2.HealthRequest())
        c1 = cpu_seconds(me)
        for _ in range(n):
            await aio.Health(common_pb2.HealthRequest())
        return 1e3 * (cpu_seconds(me) - c1) / n
    out["aio"] = asyncio.run(through_aio())
    return out


def _hop_floors(ctx: Context) -> dict:
    """The floors that need no stack, measured before it starts (nothing else runs then)."""
    n = ctx.iters(3000, 50)
    return {"bare": floors.http("bare", n), "fastapi": floors.http("fastapi", n),
            "sqlite": floors.sqlite_commit(ctx.work_dir, n), "postgres": floors.postgres_commit(ctx.work_dir, n),
            "future": floors.future_transactions(ctx.work_dir, n),
            "journal": floors.journal_append(ctx.work_dir, n)}


def run(ctx: Context) -> list[Row]:
    import tinker
    from tinker import types

    hop = _hop_floors(ctx)
    n = ctx.iters(60, 3)
    with tinkerd_up(ctx, "request_costs", ctx.models["tiny"]) as stack:
        processes = {name: psutil.Process(pid) for name, pid in service_pids(stack.pid).items() if name != "sampler"}
        processes["client"] = psutil.Process()
        service = tinker.ServiceClient(base_url=stack.url)
        tc = service.create_lora_training_client(base_model=ctx.models["tiny"], rank=8).result()
        data = [types.Datum(model_input=types.ModelInput.from_ints(list(range(5, 69))),
                            loss_fn_inputs={"target_tokens": list(range(6, 70)), "weights": [1.0] * 64})
                for _ in range(4)]
        sampler = tc.save_weights_and_get_sampling_client().result()
        one_token = types.SamplingParams(max_tokens=1, temperature=0.0)
        prompt = types.ModelInput.from_ints([5, 6, 7])

        def burst():
            for f in [sampler.sample(prompt, 1, one_token) for _ in range(BURST)]:
                f.result()
        kinds = {   # kind: (function, requests it makes, how many times)
            "forward_backward (4 x 64 tokens)": (lambda: tc.forward_backward(data, "cross_entropy").result(), 1, n),
            "optim_step": (lambda: tc.optim_step(types.AdamParams(learning_rate=1e-4)).result(), 1, n),
            "sample (1 token)": (lambda: sampler.sample(prompt, 1, one_token).result(), 1, n),
            f"sample (1 token), {BURST} at once, per sample": (burst, BURST, max(2, n // 8)),
            "save_weights_for_sampler": (lambda: tc.save_weights_for_sampler(f"c{time.monotonic_ns()}").result(),
                                         1, max(2, n // 10)),
        }
        measured = {kind: _measure(fn, times, per_call, processes, stack)
                    for kind, (fn, per_call, times) in kinds.items()}
        grpc = _grpc_floor(stack, ctx.iters(500, 5))
        # The SDK names a sampling client's session only privately; the poll above needs it.
        alone = _alone(stack, processes["gateway"], tc.model_id, sampler._sampling_session_id, ctx.iters(1000, 5))
    rows = []
    for kind, m in measured.items():
        target = TARGET_MS["sample"] if kind.startswith("sample") else 2.0
        requests = sum(m["http"].values())
        # The design's floor for the gateway: the SDK's HTTP requests served bare, one gRPC call,
        # two commits (the future's row and its finish).
        floor = requests * hop["bare"]["server"] + grpc["client"] + 2 * hop["sqlite"]
        routes = ", ".join(f"{r} {c:.2g}" for r, c in sorted(m["http"].items()))
        note = (f"HTTP requests {requests:.2g} ({routes}); trainer process {m['trainer']:.2f} ms CPU, "
                f"SDK client {m['client']:.2f} ms CPU, wall {m['wall']:.2f} ms; gateway floor {floor:.2f} ms")
        # The floor in the raw column; no ratio, so the verdict is the gateway's CPU against the target.
        rows.append(Row("request_costs", f"{kind}: gateway CPU per request", m["gateway"], floor, "ms",
                        target=f"<= {target:g}", note=note))
    for name, cpu in alone.items():
        rows.append(Row("request_costs", f"ours: {name}, one request alone, gateway CPU", cpu, hop["bare"]["server"],
                        "ms", note="raw: a bare ASGI app's request"))
    return rows + _floor_rows(hop, grpc)


def _floor_rows(hop: dict, grpc: dict) -> list[Row]:
    """Each hop's floor, and ours beside the SQLite one."""
    rows = []
    for name, label in (("bare", "a bare ASGI app"), ("fastapi", "one FastAPI route, pydantic body")):
        h = hop[name]
        rows.append(Row("request_costs", f"floor: an HTTP request to {label} under uvicorn (httptools), "
                        "server CPU", h["server"], None, "ms",
                        note=f"httpx client CPU {h['client']:.3f} ms, round trip {h['wall']:.3f} ms"))
    rows.append(Row("request_costs", "floor: a gRPC unary call (trainer Health), round trip", grpc["wall"], None,
                    "ms", note=f"client CPU {grpc['client']:.3f} ms; through grpc.aio (the gateway's) "
                    f"{grpc['aio']:.3f} ms"))
    rows.append(Row("request_costs", "floor: a SQLite WAL commit of one insert (sqlite3, synchronous=NORMAL), CPU",
                    hop["sqlite"], None, "ms"))
    rows.append(Row("request_costs", "ours: a future's two transactions (its row inserted, then finished) as the "
                    "gateway's store writes them on SQLite, CPU", hop["future"], 2 * hop["sqlite"], "ms",
                    note="raw: two sqlite3 commits"))
    if hop["postgres"] is not None:
        rows.append(Row("request_costs", "floor: a PostgreSQL commit of one insert (psycopg, unix socket, "
                        "fsync off), round trip", hop["postgres"]["wall"], None, "ms",
                        note=f"client CPU {hop['postgres']['client']:.3f} ms"))
    rows.append(Row("request_costs", "floor: a journal append (open, write, close)", hop["journal"], None, "ms"))
    return rows
