"""Gateway futures: how many no-op futures per second, and the latency the gateway adds; and
samples through the SDK with the batched poll (retrieve_futures, --sample-session-poll) against
the per-sample poll (retrieve_future, the default).

A no-op future (POST /internal/noop_future, then retrieve_future) does everything a Tinker
future does (database row, job, one gRPC call to the trainer, long-poll) around a trivial job:
the trainer's Health. Raw: the same Health call made directly over gRPC.

The SDK case: one SamplingClient submits a burst of one-token samples at once and waits for all.
Each client is told on its side how to poll (client/config's sample_use_retrieve_futures, which
the gateway serves either way): batched as with --sample-session-poll, per sample as by default
(and as every SDK before 0.28 polls).
"""

from __future__ import annotations

import asyncio
import os
import re
import statistics
import time

from bench.common import Context, Row, percentile, tinkerd_up


def _auth() -> dict:
    """The running stack's key (running_stack puts it in the environment)."""
    return {"X-API-Key": os.environ["TINKER_API_KEY"]}


def _trainer_port(state_dir: str) -> int:
    with open(f"{state_dir}/logs/trainer.log", "rb") as f:
        return int(re.search(rb"READY trainer (\d+)", f.read()).group(1))


async def _round_trip(client, internal: str) -> None:
    """A no-op future (on the gateway's internal listener: admins only), then its result (the API's
    retrieve_future, on the users' port)."""
    r = await client.post(f"{internal}/internal/noop_future")
    done = await client.post("/api/v1/retrieve_future", json={"request_id": r.json()["request_id"]})
    assert done.status_code == 200, done.text


async def _latencies(url: str, internal: str, n: int) -> list[float]:
    import httpx
    async with httpx.AsyncClient(base_url=url, headers=_auth()) as client:
        for _ in range(20):
            await _round_trip(client, internal)
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            await _round_trip(client, internal)
            out.append(time.perf_counter() - t0)
        return out


async def _throughput(url: str, internal: str, seconds: float, concurrency: int) -> float:
    """`concurrency` clients, each with its own connection (one shared httpx pool serialises
    badly: measured 145/s at 32 concurrent against 566/s with a client each)."""
    import httpx
    clients = [httpx.AsyncClient(base_url=url, headers=_auth()) for _ in range(concurrency)]
    count = 0
    deadline = time.perf_counter() + seconds

    async def worker(client):
        nonlocal count
        while time.perf_counter() < deadline:
            await _round_trip(client, internal)
            count += 1
    t0 = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in clients))
    rate = count / (time.perf_counter() - t0)
    for c in clients:
        await c.aclose()
    return rate


NOTES = [
    "futures per second: the benchmark's 32 HTTP clients, the gateway and the trainer share 2 cores; "
    "each no-op future is two HTTP requests (submit, long-poll), two SQLite writes and one gRPC call. "
    "2026-11-23 (a shared, loaded VM): 280/s and p50 6.2 ms before, 336/s and 4.0 ms after the caller and "
    "gateway dependencies became async (FastAPI ran each plain-def dependency in its thread pool: two thread "
    "hops per request). py-spy: the gateway's event loop is ~70% busy at that rate, the rest of the 2 cores "
    "goes to the benchmark's own HTTP clients and the trainer. Reaching 2,000/s needs more cores or several "
    "gateway processes (the futures table already lives in the shared database).",
    "SDK samples: with retrieve_futures the SDK still fetches each payload with one retrieve_future, so HTTP "
    "requests per sample stay ~1 (1.05 batched vs 1.00 per-sample in a burst of 400, whose samples are mostly "
    "done when first polled) and samples/s are the same within noise (92 vs 95/s, bound by the sampler). "
    "What batching removes is one held long-poll connection per in-flight sample: the SDK then lifts its "
    "2,000-samples-in-flight cap, and the gateway holds one waiter per sampling session, not per sample.",
]


def _stats(internal: str) -> dict:
    import httpx
    return httpx.get(f"{internal}/internal/futures_stats", headers=_auth()).json()["calls"]


def _sdk_burst(url: str, internal: str, model: str, n: int, batched: bool,
               rounds: int) -> tuple[float, float, float]:
    """(samples per second, median latency of one sample in s, HTTP polls per sample) for bursts
    of `n` one-token samples from one SamplingClient, the best of `rounds`."""
    import tinker
    from tinker import types

    sampler = tinker.ServiceClient(base_url=url).create_sampling_client(base_model=model).result()
    sampler.holder._client_config = sampler.holder._client_config.model_copy(
        update={"sample_use_retrieve_futures": batched})
    params = types.SamplingParams(max_tokens=1, temperature=0.0)
    prompts = [types.ModelInput.from_ints([5 + i % 50, 9, 17]) for i in range(n)]
    sampler.sample(prompts[0], 1, params).result()                 # warm: poller, connections
    best, latency, polls = 0.0, 0.0, 0.0
    for _ in range(rounds):
        before = _stats(internal)
        t0 = time.perf_counter()
        futures = [sampler.sample(p, 1, params) for p in prompts]
        done = []
        for f in futures:
            f.result(timeout=600)
            done.append(time.perf_counter() - t0)
        rate = n / (time.perf_counter() - t0)
        after = _stats(internal)
        if rate > best:
            calls = sum(after.get(k, 0) - before.get(k, 0) for k in ("retrieve_future", "retrieve_futures"))
            best, latency, polls = rate, statistics.median(done), calls / n
    return best, latency, polls


def run(ctx: Context) -> list[Row]:
    from tinkerd.rpc import ServiceAuth, channel
    from tinkerd.v1 import common_pb2, trainer_pb2_grpc

    n = ctx.iters(500, 30)
    with tinkerd_up(ctx, "futures", ctx.models["tiny"]) as stack:
        # The direct path authenticates like the gateway does: with the stack's service token.
        with open(os.path.join(stack.state_dir, "service-token")) as f:
            auth = ServiceAuth(token=f.read().strip())
        stub = trainer_pb2_grpc.TrainerStub(channel(f"127.0.0.1:{_trainer_port(stack.state_dir)}", auth))
        direct = []
        for i in range(n + 20):
            t0 = time.perf_counter()
            stub.Health(common_pb2.HealthRequest())
            if i >= 20:
                direct.append(time.perf_counter() - t0)
        via = asyncio.run(_latencies(stack.url, stack.internal_url, n))
        rate = asyncio.run(_throughput(stack.url, stack.internal_url, 1.0 if ctx.quick else 4.0, 32))
        burst, rounds = ctx.iters(400, 20), ctx.iters(3, 1)
        per_sample = _sdk_burst(stack.url, stack.internal_url, ctx.models["tiny"], burst, batched=False,
                                rounds=rounds)
        batched = _sdk_burst(stack.url, stack.internal_url, ctx.models["tiny"], burst, batched=True,
                             rounds=rounds)
    p50 = 1e3 * (statistics.median(via) - statistics.median(direct))
    p99 = 1e3 * (percentile(via, 0.99) - percentile(direct, 0.99))
    return [
        Row("futures", "no-op futures per second (32 concurrent clients in 1 process, same 2 cores)", rate, None, "/s",
            target=">= 2000"),
        Row("futures", "added latency p50 (gateway round trip - direct gRPC)", p50,
            1e3 * statistics.median(direct), "ms", target="<= 5"),
        Row("futures", "added latency p99", p99, 1e3 * percentile(direct, 0.99), "ms"),
        Row("futures", f"SDK samples per second, burst of {burst} (raw = per-sample polls)", batched[0],
            per_sample[0], "/s", ratio=batched[0] / per_sample[0],
            note=f"HTTP polls per sample {batched[2]:.2f} vs {per_sample[2]:.2f}"),
        Row("futures", f"SDK sample latency median in a burst of {burst} (raw = per-sample polls)",
            1e3 * batched[1], 1e3 * per_sample[1], "ms", ratio=per_sample[1] / batched[1]),
    ]
