"""Sampling that users can reproduce, in float32 (the shared stack); bf16's twin is in
tests/trainer/test_bf16_training.py. See conftest.assert_reproducible_sampling."""

import pytest

from conftest import assert_reproducible_sampling, sft_data

pytestmark = pytest.mark.e2e


def test_greedy_and_seeded_samples_repeat_through_a_trained_adapter(stack, tiny_model_dir):
    import tinker
    from tinker import types

    tc = tinker.ServiceClient(base_url=stack.url).create_lora_training_client(base_model=tiny_model_dir, rank=8,
                                                                           seed=0).result()
    data = sft_data(tc.get_tokenizer(), ["one two three four five", "the cat sat on the mat"])
    for _ in range(3):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    assert_reproducible_sampling(tc.save_weights_and_get_sampling_client().result(), data[0].model_input)
