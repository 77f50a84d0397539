"""A service that dies mid-run, through the unmodified SDK: `tinkerd up` restarts it on its old
port, the gateway's calls wait for it and resend, and the trainer brings every model back from
its durable state -- exactly, or saying once what was lost."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import tinker
from tinker import types

from conftest import sft_data
from harness.stack import service_pids

pytestmark = pytest.mark.e2e

TEXTS = ["the cat sat on a mat", "a cat and a hat", "the mat was red"]
ADAM = types.AdamParams(learning_rate=1e-2)


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory, start_stack):
    with start_stack(tiny_model_dir, tmp_path_factory.mktemp("state"), "--durable-interval-s", "0") as s:
        yield s


def _kill(stack, name: str) -> None:
    """SIGKILL the service and wait until `up` has started another one."""
    old = service_pids(stack.pid)[name]
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while service_pids(stack.pid).get(name) in (None, old):
        assert time.monotonic() < deadline, f"{name} was not restarted"
        time.sleep(0.2)


def _logprobs(tc, datum) -> np.ndarray:
    return tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()


def test_trainer_killed_between_requests_comes_back_exactly(stack, tiny_model_dir):
    service = tinker.ServiceClient(base_url=stack.url)
    tc = service.create_lora_training_client(base_model=tiny_model_dir, rank=4, seed=1).result()
    data = sft_data(tc.get_tokenizer(), TEXTS)
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(ADAM).result()
    before = _logprobs(tc, data[0])

    _kill(stack, "trainer")
    # The same client goes on: same weights, and the next step is step 2 on the same AdamW state.
    np.testing.assert_allclose(_logprobs(tc, data[0]), before, atol=1e-6)
    tc.forward_backward(data, "cross_entropy").result()
    assert tc.optim_step(ADAM).result().metrics["step:max"] == 2.0


def test_request_sent_while_the_trainer_is_down_waits_for_it(stack, tiny_model_dir):
    service = tinker.ServiceClient(base_url=stack.url)
    tc = service.create_lora_training_client(base_model=tiny_model_dir, rank=4, seed=2).result()
    data = sft_data(tc.get_tokenizer(), TEXTS)
    os.kill(service_pids(stack.pid)["trainer"], signal.SIGKILL)
    fb = tc.forward_backward(data, "cross_entropy")        # sent into the restart
    assert fb.result().loss_fn_outputs and np.isfinite(fb.result().metrics["loss:sum"])
    assert tc.optim_step(ADAM).result().metrics["step:max"] == 1.0


def test_lost_work_is_told_once(stack, tiny_model_dir):
    service = tinker.ServiceClient(base_url=stack.url)
    tc = service.create_lora_training_client(base_model=tiny_model_dir, rank=4, seed=3).result()
    data = sft_data(tc.get_tokenizer(), TEXTS)
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(ADAM).result()
    before = _logprobs(tc, data[0])
    tc.forward_backward(data, "cross_entropy").result()       # gradients only in memory

    _kill(stack, "trainer")
    with pytest.raises(tinker.RequestFailedError, match=r"resumed from its state at step 1 .*forward_backward"):
        tc.forward_backward(data, "cross_entropy").result()
    np.testing.assert_allclose(_logprobs(tc, data[0]), before, atol=1e-6)
    tc.forward_backward(data, "cross_entropy").result()
    assert tc.optim_step(ADAM).result().metrics["step:max"] == 2.0
