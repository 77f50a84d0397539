"""Sampler replicas come and go under a running SDK client: replicas join by registering with
the gateway, a replica killed mid-sample has its samples re-sent to another one (the SDK sees
no error), and a replica that joins late serves the newest snapshot."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import time

import pytest
import tinker
from tinker import types

from conftest import sft_data
from harness.stack import service_pids

pytestmark = pytest.mark.e2e

TEXTS = ["the cat sat on a mat", "a cat and a hat", "the mat was red"]


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory, start_stack):
    with start_stack(tiny_model_dir, tmp_path_factory.mktemp("state")) as s:
        yield s


class Replica:
    """`tinkerd sampler --register-with <gateway>` in its own process."""

    def __init__(self, stack, model_dir: str):
        self.stack = stack
        state = stack.state_dir
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "launcher.cli", "sampler", "--base-model", model_dir, "--state-dir", state,
             "--service-token-file", os.path.join(state, "service-token"), "--register-with", stack.url,
             "--max-model-len", "1024"],
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
    second = Replica(stack, tiny_model_dir)
    replicas.append(second)
    _wait_for(lambda: f"sampler replica {second.address} is up" in _pool_log(stack), "the replica never joined")

    service = tinker.ServiceClient(base_url=stack.url)
    tc = service.create_lora_training_client(base_model=tiny_model_dir, rank=4, seed=1).result()
    data = sft_data(tc.get_tokenizer(), TEXTS)
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    sc = tc.save_weights_and_get_sampling_client()
    prompt = data[0].model_input

    # Both replicas serve; then the first is killed while 8 samples are in flight.
    with concurrent.futures.ThreadPoolExecutor(1) as background:
        running = background.submit(_sample_many, sc, prompt, 8, 200)
        time.sleep(1.0)
        os.kill(service_pids(stack.pid)["sampler"], signal.SIGKILL)
        results = running.result(timeout=300)
    assert all(len(r.sequences) == 1 and len(r.sequences[0].tokens) == 200 for r in results)

    # A third replica joins; the second one dies for good. The newest snapshot is served.
    third = Replica(stack, tiny_model_dir)
    replicas.append(third)
    _wait_for(lambda: f"sampler replica {third.address} is up" in _pool_log(stack), "the third never joined")
    second.kill()
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    newest = tc.save_weights_and_get_sampling_client()
    results = _sample_many(newest, prompt, 4, 16)
    assert all(len(r.sequences[0].tokens) == 16 for r in results)
    third.proc.send_signal(signal.SIGTERM)          # a clean stop leaves the pool at once
    third.proc.wait(timeout=60)
    _wait_for(lambda: f"sampler replica {third.address} left the pool" in _pool_log(stack), "it never left")
