"""Sampling tokens/s through the API with 2 sampler replicas vs 1 (the gateway's sampler pool).

One `tinkerd up` (one replica); a second replica joins the way one on another host would
(`tinkerd sampler --register-with <gateway>`), and later leaves (SIGTERM: it deregisters). The
same batch of concurrent SDK sample requests on the base model runs with 1 replica, with 2, and
with 1 again; "ours" is 2 replicas, "raw" the median of the 1-replica rounds before and after, the
ratio 2 over 1. The note says how the gateway split the requests (the pool's served counts).

No target: every process here shares this machine's cores. Each replica's vLLM runs one OpenMP
thread (OMP_NUM_THREADS=1), so on 2 cores two replicas can at best use both cores for the engine,
but the gateway, the SDK's threads and the idle trainer compete for the same two; on the tiny
model the per-request HTTP/gRPC work outweighs the engine's. The gain a sampler pool is for
comes from replicas on machines (GPUs) of their own.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time

import torch

from bench.common import REPO, Context, Row, SharedStack, tinkerd_up
from bench.sampling import api_generate
from harness.stack import sampler_pool

PROMPT_LEN, MAX_TOKENS = 16, 48


def _prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(5, 1000, (PROMPT_LEN,), generator=gen).tolist() for _ in range(n)]



def _until(predicate, what: str, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"bench: {what} after {timeout_s:.0f} s")
        time.sleep(0.2)


def _join(stack, model_dir: str, *flags: str) -> tuple[subprocess.Popen, str]:
    """A second replica, `tinkerd sampler --register-with` the stack's gateway (with `flags`, e.g.
    the stack's dtype); (process, address) once the pool has it live."""
    state = stack.state_dir
    proc = subprocess.Popen(
        [sys.executable, "-m", "launcher.cli", "sampler", "--base-model", model_dir, "--state-dir", state,
         "--service-token-file", os.path.join(state, "service-token"), "--register-with", stack.internal_url, *flags],
        stdout=subprocess.PIPE, stderr=open(os.path.join(state, "logs", "bench-replica.log"), "ab"), text=True,
        cwd=REPO, start_new_session=True)
    for line in proc.stdout:
        if line.startswith("READY sampler"):
            address = f"127.0.0.1:{line.split()[2]}"
            _until(lambda: sampler_pool(stack).get(address, {}).get("alive"), "the second replica never joined")
            return proc, address
    raise RuntimeError(f"bench: the second replica did not start (code {proc.wait()})")



def measure(ctx: Context, name: str, model_dir: str, prompts: list[list[int]],
            rounds: int) -> tuple[float, float, str]:
    """(2-replica tokens/s, 1-replica tokens/s, how the 2-replica rounds were split)."""
    with tinkerd_up(ctx, f"replicas-{name}", model_dir) as stack:
        run = api_generate(stack.url, model_dir, prompts, MAX_TOKENS)
        run()                                                         # warm-up
        one = [run() for _ in range(rounds)]
        # The quick run's shared stack is fp32 whatever `auto` is here: the replica runs what it runs,
        # with the run's KV cache.
        proc, address = _join(stack, model_dir, *ctx.stack_flags(
            model_dir, SharedStack.DTYPE if ctx.shared is not None else ()))
        try:
            run()                                                     # the new replica's warm-up
            before = {a: m["served"] for a, m in sampler_pool(stack).items()}
            two = [run() for _ in range(rounds)]
            split = {a: m["served"] - before.get(a, 0) for a, m in sampler_pool(stack).items()}
        finally:
            proc.send_signal(signal.SIGTERM)                          # leaves the pool at once
            proc.wait(timeout=60)
        _until(lambda: address not in sampler_pool(stack), "the second replica never left")
        one += [run() for _ in range(rounds)]
    shares = "/".join(str(n) for n in sorted(split.values(), reverse=True))
    return statistics.median(two), statistics.median(one), f"requests split {shares} between the 2 replicas"


def run(ctx: Context) -> list[Row]:
    rows = []
    for name, model in ctx.models.items():
        prompts = _prompts(8 if ctx.quick else 32)
        two, one, split = measure(ctx, name, model, prompts, ctx.iters(3, 1))
        rows.append(Row("sampler_replicas", f"{name}: 2 vs 1 sampler replicas, {len(prompts)} concurrent requests, "
                                            f"{PROMPT_LEN}+{MAX_TOKENS} tokens",
                        two, one, "tok/s", ratio=two / one,
                        note=f"{split}; {os.cpu_count()} CPUs shared by every process"))
    return rows
