"""Through the unmodified SDK: a hot snapshot is served from merged weights and the SDK sees the
same logprobs as when it was served through LoRA (and as the trainer computes)."""

from __future__ import annotations

import glob
import os
import time

import numpy as np
import pytest
import tinker
from tinker import types

from conftest import sft_data

pytestmark = pytest.mark.e2e

TEXTS = ["the cat sat on a mat and the dog ran to the red ball", "one two three four five six"]


@pytest.fixture(scope="module")
def merging_stack(tiny_model_dir, tmp_path_factory, start_stack):
    """Promotion after 3 requests of a 4-request window (the default needs 4 of 32)."""
    with start_stack(tiny_model_dir, tmp_path_factory.mktemp("merged"), "--merge-window", "4",
                     "--merge-min-requests", "3") as s:
        yield s


def _sampler_log(state_dir: str) -> str:
    return "".join(open(p).read() for p in glob.glob(os.path.join(state_dir, "logs", "*sampler*")))


def _wait_for_log(state_dir: str, text: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while text not in _sampler_log(state_dir):
        assert time.monotonic() < deadline, f"no {text!r} in the sampler log after {timeout} s"
        time.sleep(0.2)


def test_hot_snapshot_is_served_merged_with_the_same_logprobs(merging_stack, tiny_model_dir):
    service = tinker.ServiceClient(base_url=merging_stack.url)
    tc = service.create_lora_training_client(base_model=tiny_model_dir, rank=8, seed=5).result()
    data = sft_data(tc.get_tokenizer(), TEXTS)
    for _ in range(3):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    sc = tc.save_weights_and_get_sampling_client().result()
    probe = data[0]
    tokens = types.ModelInput.from_ints(probe.model_input.to_ints()
                                        + [int(probe.loss_fn_inputs["target_tokens"].to_numpy()[-1])])
    trainer = tc.forward([probe], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    assert "merged slot" not in _sampler_log(merging_stack.state_dir)
    lora = [np.array(sc.compute_logprobs(tokens).result()[1:]) for _ in range(2)]   # under 3 requests: LoRA
    np.testing.assert_array_equal(lora[0], lora[1])            # one engine: bit-reproducible
    sc.compute_logprobs(tokens).result()                       # the third: promoted
    _wait_for_log(merging_stack.state_dir, "now serves snapshot")
    merged = np.array(sc.compute_logprobs(tokens).result()[1:])
    assert np.max(np.abs(merged - lora[0])) < 1e-4             # the same results (fp32)...
    assert not np.array_equal(merged, lora[0])                 # ...from the other engine (it rounds differently)
    assert np.max(np.abs(merged - trainer)) < 1e-3
    # Sampling (not only scoring) runs on the merged engine too.
    greedy = types.SamplingParams(max_tokens=8, temperature=0.0)
    out = sc.sample(types.ModelInput.from_ints(probe.model_input.to_ints()), 2, greedy).result()
    assert all(len(s.tokens) == 8 and all(np.isfinite(s.logprobs)) for s in out.sequences)


def test_a_runs_next_snapshot_is_sampled_merged_straight_after_saving(merging_stack, tiny_model_dir):
    """RL's loop: once a run's snapshot is served merged, the snapshot it saves next is merged as it
    arrives, and the rollouts sampled right after saving run on those weights instead of through
    LoRA (before: every re-merge came after the step's requests, '0 requests served merged')."""
    service = tinker.ServiceClient(base_url=merging_stack.url)
    tc = service.create_lora_training_client(base_model=tiny_model_dir, rank=8, seed=6).result()
    data = sft_data(tc.get_tokenizer(), TEXTS)
    probe = data[1]
    tokens = types.ModelInput.from_ints(probe.model_input.to_ints()
                                        + [int(probe.loss_fn_inputs["target_tokens"].to_numpy()[-1])])
    sc = tc.save_weights_and_get_sampling_client().result()
    for _ in range(3):
        sc.compute_logprobs(tokens).result()                  # hot: promoted
    for _ in range(2):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        sc = tc.save_weights_and_get_sampling_client().result()
        rollouts = [sc.sample(probe.model_input, 2, types.SamplingParams(max_tokens=6, temperature=1.0, seed=i))
                    for i in range(3)]                        # at once, as the cookbook samples a step
        scored = sc.compute_logprobs(tokens)
        assert all(len(r.result().sequences) == 2 for r in rollouts)
        trainer = tc.forward([probe], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        assert np.max(np.abs(np.array(scored.result()[1:]) - trainer)) < 1e-3
    # The first trained snapshot's slot went to the second: all 4 of its requests had run merged.
    log = [line for line in _sampler_log(merging_stack.state_dir).splitlines() if f"snapshot {tc.model_id}@" in line]
    demoted = [line for line in log if "no longer serves" in line]
    assert len(demoted) == 2 and "(4 requests served merged)" in demoted[1], "\n".join(log)
    assert not [line for line in log if "through LoRA" in line], "\n".join(log)
