"""`tinkerd up --trainer-ranks 2` through the unmodified SDK: the trainer runs as one torchrun job
of 2 ranks (ZeRO-3); training, weights for the sampler and sampling work as with one; when a
rank dies the job exits, `up` restarts it, and the same client goes on from the durable state."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import psutil
import pytest
import tinker
from tinker import types

from conftest import sft_data

pytestmark = pytest.mark.e2e

TEXTS = ["the cat sat on a mat", "a cat and a hat", "the mat was red"]
ADAM = types.AdamParams(learning_rate=1e-2)


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory, start_stack):
    with start_stack(tiny_model_dir, tmp_path_factory.mktemp("state"), "--trainer-ranks", "2", "--zero-stage", "3",
                     "--durable-interval-s", "0") as s:
        yield s


def _trainer_ranks(root_pid: int) -> dict[int, int]:
    """{rank: pid} of the trainer job's workers under `tinkerd up`."""
    found = {}
    for child in psutil.Process(root_pid).children(recursive=True):
        try:
            env, cmd = child.environ(), child.cmdline()
        except (psutil.ZombieProcess, psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if "RANK" in env and "trainer" in cmd:
            found[int(env["RANK"])] = child.pid
    return found


def _logprobs(tc, datum) -> np.ndarray:
    return tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()


def test_two_rank_trainer_trains_samples_and_survives_a_dead_rank(stack, tiny_model_dir):
    assert sorted(_trainer_ranks(stack.pid)) == [0, 1]
    service = tinker.ServiceClient(base_url=stack.url)
    tc = service.create_lora_training_client(base_model=tiny_model_dir, rank=4, seed=1).result()
    data = sft_data(tc.get_tokenizer(), TEXTS)
    first = tc.forward_backward(data, "cross_entropy").result()
    assert len(first.loss_fn_outputs) == len(TEXTS)
    tc.optim_step(ADAM).result()
    sampler = tc.save_weights_and_get_sampling_client()
    prompt = types.ModelInput.from_ints(data[0].model_input.to_ints())
    out = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=4, temperature=0.0)).result()
    assert len(out.sequences[0].tokens) == 4
    before = _logprobs(tc, data[0])

    old = _trainer_ranks(stack.pid)
    os.kill(old[1], signal.SIGKILL)
    deadline = time.monotonic() + 180
    while True:                                    # `up` restarts the whole job
        now = _trainer_ranks(stack.pid)
        if sorted(now) == [0, 1] and now[0] != old[0] and now[1] != old[1]:
            break
        assert time.monotonic() < deadline, "the trainer job was not restarted"
        time.sleep(0.5)
    np.testing.assert_allclose(_logprobs(tc, data[0]), before, atol=1e-6)
    tc.forward_backward(data, "cross_entropy").result()
    assert tc.optim_step(ADAM).result().metrics["step:max"] == 2.0
