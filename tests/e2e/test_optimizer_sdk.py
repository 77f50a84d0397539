"""The optimizer as a fixed choice of the model, through the unmodified SDK 0.38 against a real
stack: a Dimuon model is reported as Dimuon, learns, lands elsewhere than AdamW from the same seed,
refuses AdamParams (and an AdamW model DimuonParams) with a 400 naming both, and resumes exactly,
with its momentum, from a full-state save: as a new model, and loaded into one of its own."""

from __future__ import annotations

import os

import numpy as np
import pytest
import tinker
from tinker import types

from conftest import sft_data

pytestmark = pytest.mark.e2e

TEXTS = ["alpha beta gamma delta epsilon", "the dog and the red ball ran", "one two three four"]
DIMUON = types.DimuonParams(learning_rate=0.05)
ADAM = types.AdamParams(learning_rate=1e-2)


@pytest.fixture(scope="module")
def service(start_stack, tiny_model_dir, tmp_path_factory):
    """A stack of this module's own, its services computing on one thread each: a resumed model
    is held to step exactly as the original, and with `auto` a step's thread count follows which
    compute processes on the host are busy (tinkerd/cores.py: other tests' stacks too), so two
    steps could sum in a different order (the suite saw one such difference)."""
    before = os.environ.get("TINKERD_CPU_THREADS")
    os.environ["TINKERD_CPU_THREADS"] = "1"            # what the stack's services start with
    try:
        own = start_stack(tiny_model_dir, tmp_path_factory.mktemp("optimizer-state"))
        stack = own.__enter__()
    finally:
        if before is None:
            del os.environ["TINKERD_CPU_THREADS"]
        else:
            os.environ["TINKERD_CPU_THREADS"] = before
    try:
        yield tinker.ServiceClient(base_url=stack.url, api_key=stack.api_key)
    finally:
        own.__exit__(None, None, None)


def _step(tc, data, params) -> float:
    loss = tc.forward_backward(data, "cross_entropy")
    step = tc.optim_step(params)
    out = loss.result()
    step.result()
    return out.metrics["loss:sum"]


def _logprobs(tc, data) -> np.ndarray:
    out = tc.forward(data, "cross_entropy").result()
    return np.concatenate([o["logprobs"].to_numpy() for o in out.loss_fn_outputs])


def test_a_dimuon_model_is_reported_learns_and_refuses_adam(service, tiny_model_dir):
    dimuon = service.create_lora_training_client(base_model=tiny_model_dir, rank=8, seed=60,
                                                 optimizer=types.DimuonOptimizerConfig()).result()
    adamw = service.create_lora_training_client(base_model=tiny_model_dir, rank=8, seed=60).result()
    assert (dimuon.get_info().optimizer_config.type, dimuon.get_info().optimizer_config.version) == ("dimuon", 1)
    assert adamw.get_info().optimizer_config == types.AdamOptimizerConfig()
    data = sft_data(dimuon.get_tokenizer(), TEXTS)
    start = _logprobs(dimuon, data)
    assert np.array_equal(start, _logprobs(adamw, data))        # the same seed: the same model so far

    losses = [_step(dimuon, data, DIMUON) for _ in range(5)]
    assert losses[-1] < 0.8 * losses[0], losses
    for _ in range(5):
        _step(adamw, data, ADAM)
    assert np.max(np.abs(_logprobs(dimuon, data) - _logprobs(adamw, data))) > 1e-3

    with pytest.raises(tinker.BadRequestError, match="created with the dimuon optimizer; optim_step got AdamParams"):
        dimuon.optim_step(ADAM).result()
    with pytest.raises(tinker.BadRequestError, match="created with the adamw optimizer; optim_step got DimuonParams"):
        adamw.optim_step(DIMUON).result()
    before = _logprobs(dimuon, data)
    _step(dimuon, data, DIMUON)                       # the refused step left the model's order going
    assert np.max(np.abs(_logprobs(dimuon, data) - before)) > 1e-4


def test_a_dimuon_model_resumes_exactly_from_a_full_state_save(service, tiny_model_dir):
    """From save_state: a new model with the optimizer state (create-by-load) is Dimuon and steps
    exactly as the original; so does a Dimuon model that loads it (load_state_with_optimizer);
    one loaded with weights only starts a fresh optimizer (AdamW unless asked, Dimuon with fresh
    momentum if asked) and steps elsewhere."""
    tc = service.create_lora_training_client(base_model=tiny_model_dir, rank=8, seed=61,
                                             optimizer=types.DimuonOptimizerConfig()).result()
    data = sft_data(tc.get_tokenizer(), TEXTS)
    for _ in range(3):
        _step(tc, data, DIMUON)
    path = tc.save_state("dimuon-3").result().path
    saved = _logprobs(tc, data)
    assert service.create_rest_client().get_weights_info_by_tinker_path(path).result().optimizer_config.type == "dimuon"

    resumed = service.create_training_client_from_state_with_optimizer(path).result()
    loaded = service.create_lora_training_client(base_model=tiny_model_dir, rank=8, seed=99,
                                                 optimizer=types.DimuonOptimizerConfig()).result()
    loaded.load_state_with_optimizer(path).result()
    assert np.array_equal(_logprobs(loaded, data), saved)
    fresh = service.create_training_client_from_state(path, optimizer=types.DimuonOptimizerConfig()).result()
    weights_only = service.create_training_client_from_state(path).result()
    assert resumed.get_info().optimizer_config.type == fresh.get_info().optimizer_config.type == "dimuon"
    assert weights_only.get_info().optimizer_config == types.AdamOptimizerConfig()
    with pytest.raises(tinker.BadRequestError, match="optim_step got AdamParams"):
        resumed.optim_step(ADAM).result()

    for client in (tc, resumed, loaded, fresh):
        _step(client, data, DIMUON)
    after = _logprobs(tc, data)
    assert np.array_equal(_logprobs(resumed, data), after)
    assert np.array_equal(_logprobs(loaded, data), after)
    assert np.max(np.abs(_logprobs(fresh, data) - after)) > 1e-4      # its momentum started at zero
