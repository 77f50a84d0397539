"""target_prompt_logprobs through the unmodified SDK 0.38 on the shared float32 stack: the sampler
scores the token ids a caller names at each prompt position in the prefill, with the weights it
serves, and they equal the trainer's forward logprobs of those tokens (1e-5; the ids at the
prompt's own tokens equal the sampler's prompt_logprobs exactly); dense and sparse CSR come back
in their own layout, 0 where nothing was asked. Bad shapes and ids are a 400 naming the field.
Layout and checks in detail: tests/unit/test_prompt_target_layout.py; the engine's scoring in a
mixed LoRA batch: tests/sampler/test_grouped_lora_engine.py."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from conftest import sft_data

pytestmark = pytest.mark.e2e

TEXT = "the cat sat on the mat and looked at the dog"
TOL = 1e-5


@pytest.fixture(scope="module")
def trained(stack, tiny_model_dir):
    """A trained adapter (it moves every logprob) and a snapshot sampler of it."""
    tc = tinker.ServiceClient(base_url=stack.url).create_lora_training_client(base_model=tiny_model_dir, rank=8,
                                                                           seed=5).result()
    data = sft_data(tc.get_tokenizer(), [TEXT, "one two three four five"])
    for _ in range(2):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    prompt = tc.get_tokenizer().encode(TEXT)
    vocab = json.loads((pathlib.Path(tiny_model_dir) / "config.json").read_text())["vocab_size"]
    return tc, tc.save_weights_and_get_sampling_client().result(), prompt, vocab


def _trainer_logprobs(tc, prompt: list[int], ids: np.ndarray) -> np.ndarray:
    """The trainer's forward logprob of ids[i, j] at prompt position i + 1: one datum a column."""
    data = [types.Datum(model_input=types.ModelInput.from_ints(prompt[:-1]),
                        loss_fn_inputs={"target_tokens": np.where(col >= 0, col, 0).tolist(),
                                        "weights": [1.0] * len(col)}) for col in ids.T]
    outs = tc.forward(data, "cross_entropy").result().loss_fn_outputs
    return np.stack([o["logprobs"].to_numpy() for o in outs], axis=1)


def _targets(prompt: list[int], vocab: int) -> np.ndarray:
    """[len(prompt) - 1, 3]: the prompt's own next token, an id from elsewhere in the vocabulary,
    and a third on every other row only (-1 between)."""
    nxt = np.array(prompt[1:], dtype=np.int64)
    third = np.where(np.arange(len(nxt)) % 2 == 0, (nxt * 7 + 11) % vocab, -1)
    return np.stack([nxt, (nxt * 31 + 5) % vocab, third], axis=1)


def test_target_logprobs_equal_the_trainers_forward_dense_and_sparse(trained):
    tc, sampler, prompt, vocab = trained
    ids = _targets(prompt, vocab)
    want = _trainer_logprobs(tc, prompt, ids)

    reply = sampler.sample(types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=2),
                           include_prompt_logprobs=True,
                           target_prompt_logprobs=types.TensorData.from_numpy(ids)).result()
    got = reply.target_prompt_logprobs
    assert got.dtype == "float32" and got.shape == list(ids.shape) and got.sparse_crow_indices is None
    got = got.to_numpy()
    asked = ids >= 0
    assert np.abs(got - want)[asked].max() < TOL, (got, want)
    assert (got[~asked] == 0).all() and (got[asked] < 0).all()
    np.testing.assert_array_equal(got[:, 0], np.array(reply.prompt_logprobs[1:], dtype=np.float32))
    assert len(reply.sequences) == 2

    # Sparse, as the SDK's docstring sends it: a few cells from row 10 on; the reply lists the same cells.
    late = np.full_like(ids, -1)
    late[10:, 1] = ids[10:, 1]
    late[12, 2] = 3
    want[12, 2] = _trainer_logprobs(tc, prompt, late[:, 2:])[12, 0]
    sparse = types.TensorData.from_torch_sparse(torch.from_numpy(late), pad_value=-1)
    assert sparse.sparse_crow_indices is not None
    reply = sampler.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=1),
                           target_prompt_logprobs=sparse).result()
    got = reply.target_prompt_logprobs
    assert (got.sparse_crow_indices, got.sparse_col_indices) == (sparse.sparse_crow_indices, sparse.sparse_col_indices)
    asked = late >= 0
    dense = got.to_numpy()
    assert np.abs(dense - want)[asked].max() < TOL and (dense[~asked] == 0).all()
    assert reply.prompt_logprobs is None


def test_bad_targets_are_a_400_naming_the_field(trained):
    tc, sampler, prompt, vocab = trained
    model_input = types.ModelInput.from_ints(prompt)
    for ids, words in [(np.zeros((len(prompt), 1), dtype=np.int64), ["target_prompt_logprobs", "has shape"]),
                       (np.full((len(prompt) - 1, 1), vocab + 5, dtype=np.int64), ["target_prompt_logprobs",
                                                                                  "outside the vocabulary"]),
                       (np.full((len(prompt) - 1, 2), -1, dtype=np.int64), ["target_prompt_logprobs",
                                                                          "names no token id"])]:
        with pytest.raises(tinker.BadRequestError) as e:
            sampler.sample(model_input, 1, types.SamplingParams(max_tokens=1),
                           target_prompt_logprobs=types.TensorData.from_numpy(ids)).result()
        assert all(w in str(e.value) for w in words), str(e.value)
    # The same client samples on.
    assert sampler.sample(model_input, 1, types.SamplingParams(max_tokens=1)).result().sequences
