"""Sampler replicas come and go under a running SDK client: `tinkerd up --sampler-replicas 2` runs
two replicas that join by registering with the gateway and both serve; a replica killed
mid-sample has its samples re-sent to another one (the SDK sees no error); a replica started on
its own (`tinkerd sampler --register-with`) joins late and serves the newest snapshot."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import tinker
from tinker import types

from conftest import TINY_KV_CACHE, sft_data
from harness.stack import sampler_pool

pytestmark = pytest.mark.e2e

TEXTS = ["the cat sat on a mat", "a cat and a hat", "the mat was red"]


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory, start_stack):
    with start_stack(tiny_model_dir, tmp_path_factory.mktemp("state"), "--sampler-replicas", "2") as s:
        yield s


class Replica:
    """`tinkerd sampler --register-with <gateway>` in its own process."""

    def __init__(self, stack, model_dir: str):
        self.stack = stack
        state = stack.state_dir
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "launcher.cli", "sampler", "--base-model", model_dir, "--state-dir", state,
             "--service-token-file", os.path.join(state, "service-token"), "--register-with", stack.internal_url,
             "--max-model-len", "1024", "--dtype", "float32", *TINY_KV_CACHE],     # as the stack's (conftest.py)
            stdout=subprocess.PIPE, stderr=open(os.path.join(state, "logs", f"replica-{id(self)}.log"), "ab"),
            text=True, start_new_session=True)
        for line in self.proc.stdout:
            if line.startswith("READY sampler"):
                self.address = f"127.0.0.1:{line.split()[2]}"
                return
        raise RuntimeError(f"the replica did not start (code {self.proc.wait()})")

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()



def _up_replicas(stack, pool: dict) -> dict[str, int]:
    """{address in the pool: pid} of the replicas `tinkerd up` runs (its `tinkerd sampler` children)."""
    found = {}
    for child in psutil.Process(stack.pid).children():
        cmd = child.cmdline()
        if len(cmd) > 3 and cmd[3] == "sampler":
            listen = [c.laddr.port for c in child.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
            found.update({f"127.0.0.1:{port}": child.pid for port in listen if f"127.0.0.1:{port}" in pool})
    return found


def _pool_log(stack) -> str:
    with open(os.path.join(stack.state_dir, "logs", "gateway.log")) as f:
        return f.read()


def _wait_for(predicate, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def _sample_many(sc, prompt, n: int, max_tokens: int) -> list:
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, stop=[])
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(lambda: sc.sample(prompt, 1, params).result()) for _ in range(n)]
        return [f.result(timeout=300) for f in futures]


@pytest.fixture
def replicas():
    """Replicas started by a test; killed after it whatever happened."""
    started: list[Replica] = []
    yield started
    for replica in started:
        if replica.proc.poll() is None:
            replica.kill()


def test_replicas_join_fail_over_and_serve_the_newest_snapshot(stack, tiny_model_dir, replicas):
    # `tinkerd up --sampler-replicas 2`: both replicas registered themselves (no --sampler list)
    # and are live by the time the stack is ready.
    pool = sampler_pool(stack)
    assert len(pool) == 2 and all(m["alive"] and m["registered"] for m in pool.values()), pool
    up_replicas = _up_replicas(stack, pool)
    assert len(up_replicas) == len(set(up_replicas.values())) == 2, (up_replicas, pool)

    service = tinker.ServiceClient(base_url=stack.url)
    tc = service.create_lora_training_client(base_model=tiny_model_dir, rank=4, seed=1).result()
    data = sft_data(tc.get_tokenizer(), TEXTS)
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    sc = tc.save_weights_and_get_sampling_client()
    prompt = data[0].model_input

    # Both replicas hold the snapshot (it was pushed to each) and serve its samples.
    _sample_many(sc, prompt, 8, 32)
    served = {address: m["served"] for address, m in sampler_pool(stack).items()}
    assert all(n > 0 for n in served.values()), served
    # Replicas on the trainer's host, on the CPU: the adapter went through shared memory.
    assert {m["weight_transport"] for m in sampler_pool(stack).values()} == {"shm"}, sampler_pool(stack)

    # One is killed while 8 samples are in flight: they all finish (`up` restarts it meanwhile).
    with concurrent.futures.ThreadPoolExecutor(1) as background:
        running = background.submit(_sample_many, sc, prompt, 8, 200)
        time.sleep(1.0)
        os.kill(next(iter(up_replicas.values())), signal.SIGKILL)
        results = running.result(timeout=300)
    assert all(len(r.sequences) == 1 and len(r.sequences[0].tokens) == 200 for r in results)

    # A replica started on its own joins and serves the newest snapshot.
    third = Replica(stack, tiny_model_dir)
    replicas.append(third)
    _wait_for(lambda: sampler_pool(stack).get(third.address, {}).get("alive"), "the third never joined")
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    newest = tc.save_weights_and_get_sampling_client()
    results = _sample_many(newest, prompt, 6, 16)
    assert all(len(r.sequences[0].tokens) == 16 for r in results)
    assert sampler_pool(stack)[third.address]["served"] > 0
    third.proc.send_signal(signal.SIGTERM)          # a clean stop leaves the pool at once
    third.proc.wait(timeout=60)
    _wait_for(lambda: f"sampler replica {third.address} left the pool" in _pool_log(stack), "it never left")
