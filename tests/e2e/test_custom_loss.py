"""Server-side custom losses through the unmodified SDK (>= 0.36): the server advertises
custom_loss_server_side, ServiceClient.create_custom_loss uploads the traced loss, and
forward_backward_custom with its LossHandle runs it on the trainer in one call, giving what the
same loss gives run client-side (the SDK's forward, local loss, weighted backward): losses,
metrics, logprobs, and the adapter after an optimizer step."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from conftest import sft_data
from loss_examples import dpo_loss, ppo_loss

pytestmark = pytest.mark.e2e

TEXTS = ["the cat sat on a mat and the dog ran to the red ball", "one two three four five",
         "the red ball and the cat", "a dog and a cat"]


@pytest.fixture(scope="module")
def service(stack):
    return tinker.ServiceClient(base_url=stack.url)


def _data(tok, kind: str) -> list[types.Datum]:
    rng = np.random.default_rng(0)
    out = []
    for i, datum in enumerate(sft_data(tok, TEXTS)):
        n = datum.model_input.length
        inputs = dict(datum.loss_fn_inputs)
        if kind == "dpo":
            inputs["ref_logprobs"] = types.TensorData.from_numpy(-rng.random(n, dtype=np.float32) * 5)
            inputs["sign"] = types.TensorData(data=[1.0 if i % 2 == 0 else -1.0], dtype="float32", shape=[])
        else:
            inputs["old_logprobs"] = types.TensorData.from_numpy(-rng.random(n, dtype=np.float32) * 5)
            inputs["advantages"] = types.TensorData.from_numpy(rng.standard_normal(n).astype(np.float32))
        out.append(types.Datum(model_input=datum.model_input, loss_fn_inputs=inputs))
    return out


def test_the_capability_is_reported(service):
    assert service.holder.get_client_config().custom_loss_server_side is True


@pytest.mark.parametrize("fn, ranks, kind", [
    (dpo_loss, {"logprobs": 1, "ref_logprobs": 1, "sign": 0}, "dpo"),
    (ppo_loss, {"logprobs": 1, "old_logprobs": 1, "advantages": 1}, "ppo"),
], ids=["dpo", "ppo"])
def test_server_side_loss_equals_client_side(service, tiny_model_dir, fn, ranks, kind):
    handle = service.create_custom_loss(fn, input_ranks=ranks).result()
    assert handle.loss_id is not None and handle.loss_id.endswith(":loss:" + handle.loss_id.rsplit(":", 1)[1])
    local = dataclasses.replace(handle, loss_id=None)       # the same traced loss, run by the SDK itself
    server_tc = service.create_lora_training_client(base_model=tiny_model_dir, rank=4, seed=7).result()
    client_tc = service.create_lora_training_client(base_model=tiny_model_dir, rank=4, seed=7).result()
    data = _data(server_tc.get_tokenizer(), kind)

    ours = server_tc.forward_backward_custom(data, handle).result()
    theirs = client_tc.forward_backward_custom(data, local).result()
    assert set(ours.metrics) == set(theirs.metrics)
    for key, value in theirs.metrics.items():
        assert ours.metrics[key] == pytest.approx(value, abs=1e-4), key
    for a, b in zip(ours.loss_fn_outputs, theirs.loss_fn_outputs):
        assert np.allclose(a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), atol=1e-6)

    adam = types.AdamParams(learning_rate=1e-2)
    server_tc.optim_step(adam).result()
    client_tc.optim_step(adam).result()
    plain = [types.Datum(model_input=d.model_input, loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"]})
             for d in data]
    after_ours = server_tc.forward(plain, "cross_entropy").result().loss_fn_outputs
    after_theirs = client_tc.forward(plain, "cross_entropy").result().loss_fn_outputs
    moved = 0.0
    for a, b, before in zip(after_ours, after_theirs, ours.loss_fn_outputs):
        assert np.allclose(a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), atol=1e-5)
        moved = max(moved, float(np.abs(a["logprobs"].to_numpy() - before["logprobs"].to_numpy()).max()))
    assert moved > 1e-4      # the step did change the adapter


def reinforce_loss(logprobs, advantages):
    return -(logprobs * advantages).sum(), {}


def test_inputs_the_loss_lacks_are_refused(service, tiny_model_dir):
    handle = service.create_custom_loss(reinforce_loss, input_ranks={"logprobs": 1, "advantages": 1}).result()
    tc = service.create_lora_training_client(base_model=tiny_model_dir, rank=4).result()
    data = _data(tc.get_tokenizer(), "ppo")
    del data[0].loss_fn_inputs["advantages"]
    # The SDK checks first; the server refuses the same on its own (a client that skips the check).
    with pytest.raises(ValueError, match="advantages"):
        tc.forward_backward_custom(data, handle)
    with pytest.raises(tinker.BadRequestError, match="advantages"):
        tc.forward_backward(data, "custom", {"loss_id": handle.loss_id}).result()
