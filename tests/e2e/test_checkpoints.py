"""State and checkpoints through the SDK: save_state, create-from-state with and without the
optimizer, named sampler checkpoints, and the RestClient registry (runs, checkpoints, sessions)."""

from __future__ import annotations

import os

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from conftest import sft_data

pytestmark = pytest.mark.e2e

TEXTS = ["alpha beta gamma delta epsilon", "the dog and the red ball ran", "one two three four"]


@pytest.fixture(scope="module")
def service(stack):
    return tinker.ServiceClient(base_url=stack.url)


def _data(tok):
    return sft_data(tok, TEXTS)


def _logprobs(tc, data) -> np.ndarray:
    out = tc.forward(data, "cross_entropy").result()
    return np.concatenate([o["logprobs"].to_numpy() for o in out.loss_fn_outputs])


def _train(tc, data, steps=1):
    for _ in range(steps):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()


def test_save_state_and_resume_with_and_without_optimizer(service, tiny_model_dir):
    tc = service.create_lora_training_client(base_model=tiny_model_dir, rank=8, seed=40).result()
    data = _data(tc.get_tokenizer())
    _train(tc, data, steps=2)
    path = tc.save_state("step-2").result().path
    assert path == f"tinker://{tc.model_id}/weights/step-2"

    with pytest.raises(tinker.BadRequestError, match="already exists"):    # a 400 with category user
        tc.save_state("step-2").result()
    assert tc.save_state("step-2", overwrite=True).result().path == path

    resumed = service.create_training_client_from_state_with_optimizer(path).result()
    fresh_opt = service.create_training_client_from_state(path).result()
    assert resumed.model_id != tc.model_id and resumed.model_id.endswith(tuple(":train:%d" % i for i in range(99)))
    before = _logprobs(tc, data)
    assert np.max(np.abs(_logprobs(resumed, data) - before)) < 1e-6
    assert np.max(np.abs(_logprobs(fresh_opt, data) - before)) < 1e-6
    info = resumed.get_info()
    assert info.model_data.model_name == tiny_model_dir and info.lora_rank == 8

    # One more step: with its AdamW state the resumed model moves exactly like the original;
    # with a fresh optimizer it does not.
    for client in (tc, resumed, fresh_opt):
        _train(client, data)
    after = _logprobs(tc, data)
    assert np.max(np.abs(_logprobs(resumed, data) - after)) < 1e-5
    assert np.max(np.abs(_logprobs(fresh_opt, data) - after)) > 1e-4


def test_registry_lists_publishes_expires_and_deletes(service, tiny_model_dir, stack):
    tc = service.create_lora_training_client(base_model=tiny_model_dir, rank=4, seed=41).result()
    data = _data(tc.get_tokenizer())
    _train(tc, data)
    state_path = tc.save_state("ckpt-a", user_metadata={"note": "x"}).result().path
    sampler_path = tc.save_weights_for_sampler("sampler-a").result().path
    rc = service.create_rest_client()

    run = rc.get_training_run(tc.model_id).result()
    assert run.training_run_id == tc.model_id and run.lora_rank == 4 and run.base_model == tiny_model_dir
    assert run.last_checkpoint.tinker_path == state_path
    assert run.last_sampler_checkpoint.tinker_path == sampler_path
    assert tc.model_id in [r.training_run_id for r in rc.list_training_runs(limit=1000).result().training_runs]

    ckpts = {c.checkpoint_id: c for c in rc.list_checkpoints(tc.model_id).result().checkpoints}
    assert set(ckpts) == {"weights/ckpt-a", "sampler_weights/sampler-a"}
    assert ckpts["weights/ckpt-a"].checkpoint_type == "training" and ckpts["weights/ckpt-a"].size_bytes > 0
    assert state_path in [c.tinker_path for c in rc.list_user_checkpoints(limit=1000).result().checkpoints]

    rc.publish_checkpoint_from_tinker_path(state_path).result()
    assert {c.checkpoint_id: c for c in rc.list_checkpoints(tc.model_id).result().checkpoints}[
        "weights/ckpt-a"].public
    rc.unpublish_checkpoint_from_tinker_path(state_path).result()
    rc.set_checkpoint_ttl_from_tinker_path(state_path, 7200).result()
    ckpt = {c.checkpoint_id: c for c in rc.list_checkpoints(tc.model_id).result().checkpoints}["weights/ckpt-a"]
    assert not ckpt.public and ckpt.expires_at is not None

    info = rc.get_weights_info_by_tinker_path(state_path).result()
    assert info.base_model == tiny_model_dir and info.is_lora and info.lora_rank == 4

    session = rc.get_session(tc.model_id.split(":train:")[0]).result()
    assert tc.model_id in session.training_run_ids
    assert tc.model_id.split(":train:")[0] in rc.list_sessions(limit=1000).result().sessions

    # A checkpoint addressed through another run is not found; deleting removes it for good.
    other = service.create_lora_training_client(base_model=tiny_model_dir, rank=4, seed=42).result()
    r = httpx.delete(f"{stack.url}/api/v1/training_runs/{other.model_id}/checkpoints/weights/ckpt-a",
                     headers={"X-API-Key": stack.api_key})
    assert r.status_code == 404 and r.json()["category"] == "user"
    rc.delete_checkpoint_from_tinker_path(state_path).result()
    assert "weights/ckpt-a" not in [c.checkpoint_id for c in rc.list_checkpoints(tc.model_id).result().checkpoints]
    with pytest.raises(tinker.NotFoundError, match="unknown checkpoint"):
        service.create_training_client_from_state(state_path).result()


def test_external_weights_are_served_as_plain_files(service, tiny_model_dir, stack):
    tc = service.create_lora_training_client(base_model=tiny_model_dir, rank=4, seed=43).result()
    _train(tc, _data(tc.get_tokenizer()))
    path = tc.save_weights_external("export-1").result().path
    assert path == f"tinker://{tc.model_id}/external_weights/export-1"
    urls = service.create_rest_client().get_external_weights_urls(path).result().urls
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(urls)
    config = httpx.get(urls["adapter_config.json"]).json()
    assert config["r"] == 4 and config["peft_type"] == "LORA"
    # Everything the services wrote (database, keys, logs, this checkpoint) is its owner's only.
    shared = [(p, oct(os.stat(p).st_mode & 0o777)) for root, dirs, files in os.walk(stack.state_dir)
              for p in [root, *(os.path.join(root, f) for f in files)] if os.stat(p).st_mode & 0o077]
    assert not shared, shared


def test_bad_checkpoint_paths_are_user_errors(service, tiny_model_dir):
    with pytest.raises(tinker.BadRequestError, match="not a tinker://"):
        service.create_training_client_from_state("/tmp/somewhere").result()
    with pytest.raises(tinker.NotFoundError, match="unknown checkpoint"):
        service.create_training_client_from_state("tinker://nobody:train:0/weights/x").result()
    tc = service.create_lora_training_client(base_model=tiny_model_dir, rank=4, seed=44).result()
    with pytest.raises((tinker.BadRequestError, tinker.RequestFailedError), match="must match"):
        tc.save_state("bad name with spaces").result()


def test_checkpoints_outlive_a_restart(tiny_model_dir, tmp_path, start_stack):
    """Named sampler checkpoints and training checkpoints open again after `tinkerd up` restarts
    on the same state directory (the sampler re-registers the snapshot from its PEFT copy)."""
    state = tmp_path / "state"
    with start_stack(tiny_model_dir, state) as first:
        service = tinker.ServiceClient(base_url=first.url)
        tc = service.create_lora_training_client(base_model=tiny_model_dir, rank=8, seed=45).result()
        data = _data(tc.get_tokenizer())
        _train(tc, data, steps=2)
        sampler_path = tc.save_weights_for_sampler("keep").result().path
        state_path = tc.save_state("keep").result().path
        prompt = types.ModelInput.from_ints(tc.get_tokenizer().encode(TEXTS[0]))
        sampled = service.create_sampling_client(model_path=sampler_path).compute_logprobs(prompt).result()
        trained = _logprobs(tc, data)
        service.close("success").result()
    with start_stack(tiny_model_dir, state) as second:
        service = tinker.ServiceClient(base_url=second.url)
        again = service.create_sampling_client(model_path=sampler_path).compute_logprobs(prompt).result()
        assert np.max(np.abs(np.array(again[1:]) - np.array(sampled[1:]))) < 1e-5
        resumed = service.create_training_client_from_state_with_optimizer(state_path).result()
        assert np.max(np.abs(_logprobs(resumed, data) - trained)) < 1e-6
        service.close("success").result()
