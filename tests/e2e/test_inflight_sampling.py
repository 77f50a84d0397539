"""Inflight sampling clients (SDK 0.38, `save_weights_and_get_sampling_client(kind="inflight")`),
through the unmodified SDK against the shared stack: every inflight client of a training model
samples its newest inflight save, one made before three steps and a second inflight save
included, while a snapshot client keeps its weights; a bad `kind` is a 400 naming it."""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest

from conftest import sft_data

pytestmark = pytest.mark.e2e

TEXTS = ["the cat sat on a mat", "one two three four five"]


def _scores(client, probe) -> np.ndarray:
    from tinker import types
    return np.array(client.compute_logprobs(types.ModelInput.from_ints(probe)).result()[1:], dtype=np.float64)


def test_inflight_clients_follow_the_newest_inflight_save(stack, tiny_model_dir):
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=stack.url)
    tc = service.create_lora_training_client(base_model=tiny_model_dir, rank=8, seed=5).result()
    tok = tc.get_tokenizer()
    data = sft_data(tok, TEXTS)
    probe = tok.encode("the cat sat on a red mat")
    early = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    snapshot = tc.save_weights_and_get_sampling_client().result()
    before = _scores(snapshot, probe)
    np.testing.assert_allclose(_scores(early, probe), before, atol=1e-5)

    for _ in range(3):
        tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=2e-2))
    late = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    datum = types.Datum(model_input=types.ModelInput.from_ints(probe[:-1]),
                        loss_fn_inputs={"target_tokens": probe[1:], "weights": [1.0] * (len(probe) - 1)})
    trained = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    assert np.abs(trained - before).max() > 0.05          # the steps moved the weights

    deadline = time.monotonic() + 30
    while np.abs(_scores(early, probe) - trained).max() > 1e-4:
        assert time.monotonic() < deadline, "the inflight client made first never reached the newest save"
        time.sleep(0.5)
    np.testing.assert_allclose(_scores(late, probe), trained, atol=1e-4)
    np.testing.assert_array_equal(_scores(snapshot, probe), before)      # a snapshot keeps its weights
    sampled = early.sample(types.ModelInput.from_ints(probe[:4]), 2, types.SamplingParams(max_tokens=4)).result()
    assert len(sampled.sequences) == 2


@pytest.mark.parametrize("body, words", [
    ({"kind": "streaming", "sampling_session_seq_id": 90}, ["kind", "snapshot", "inflight"]),
    ({"kind": "inflight", "path": "named"}, ["kind 'inflight'", "not a named checkpoint"]),
])
def test_a_bad_kind_is_refused(stack, tiny_model_dir, body, words):
    import tinker

    service = tinker.ServiceClient(base_url=stack.url)
    tc = service.create_lora_training_client(base_model=tiny_model_dir, rank=4).result()
    r = httpx.post(f"{stack.url}/api/v1/save_weights_for_sampler", headers={"X-API-Key": stack.api_key},
                   json={"model_id": tc.model_id, "seq_id": 1, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    for word in words:
        assert word in error, error


def test_unpickled_sampling_clients_join_with_their_own_clone_ids(stack, tiny_model_dir):
    """SDK 0.38 with sample_join_sampling_session: a SamplingClient sent to another process (here,
    pickled and unpickled) asks join_sampling_session for its clone id before its first sample;
    every clone gets its own, so their request seq_ids (the resend keys of their samples) never
    collide."""
    import pickle

    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=stack.url)
    sampler = service.create_sampling_client(base_model=tiny_model_dir)
    clones = [pickle.loads(pickle.dumps(sampler)) for _ in range(3)]
    params = types.SamplingParams(max_tokens=3)
    for client in [sampler, *clones]:
        assert len(client.sample(types.ModelInput.from_ints([5, 6, 7]), 1, params).result().sequences) == 1
    assert sorted(c._cloned_sampler_id for c in clones) == [1, 2, 3]       # the original is 0
