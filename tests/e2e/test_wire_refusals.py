"""What SDK 0.38 can ask for and tinkerd does not serve is refused, through the real SDK on the
shared `tinkerd up`: a 400 (category user) whose message names the field, and nothing made or
stored by the refused call. tests/unit/test_wire_coverage.py holds every field of the SDK's
requests to being served, refused or listed; this drives the refusals over HTTP as the SDK sends
them (its JSON, its header for copy_weights' token)."""

from __future__ import annotations

import httpx
import pytest
import tinker
from tinker import types

from conftest import sft_data

pytestmark = pytest.mark.e2e


def _refused(call, *words: str) -> str:
    with pytest.raises(tinker.BadRequestError) as e:
        call()
    text = str(e.value)
    assert all(w in text for w in ("is not served by this server", *words)), text
    return text


@pytest.fixture(scope="module")
def trained(stack, tiny_model_dir):
    service = tinker.ServiceClient(base_url=stack.url)
    tc = service.create_lora_training_client(base_model=tiny_model_dir, rank=4, seed=11)
    tc.forward_backward(sft_data(tc.get_tokenizer(), ["honour or refuse, never change"]), "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return service, tc, tc.save_state("refusals").result().path


def test_refused_fields_of_training_and_sampling_calls(trained, stack):
    service, tc, state = trained
    rest = service.create_rest_client()
    runs = {r.training_run_id for r in rest.list_training_runs(limit=10_000).result().training_runs}
    checkpoints = {c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints}

    _refused(lambda: service.create_training_client_from_state(state, base_model="Qwen/Qwen3-8B").result(),
             "base_model")

    sampler = tc.save_weights_and_get_sampling_client()
    prompt = tc.get_tokenizer().encode("score these tokens")
    _refused(lambda: sampler.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=1),
                                    prompt_alt_tokens_k=4).result(),
             "prompt_alt_tokens_k")

    # Nothing was made by the refused calls: no run, no checkpoint; the snapshot sampler still samples.
    assert {r.training_run_id for r in rest.list_training_runs(limit=10_000).result().training_runs} == runs
    assert {c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints} == checkpoints
    assert sampler.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=2)).result().sequences


def test_an_unknown_optimizer_or_sampling_client_kind_is_refused_by_name(trained, stack):
    """Raw JSON as the SDK shapes it, with values no SDK 0.38 type lets a caller build."""
    _, tc, _ = trained
    headers = {"X-API-Key": stack.api_key}
    got = httpx.post(f"{stack.url}/api/v1/save_weights_for_sampler", headers=headers, json={
        "model_id": tc.model_id, "seq_id": 999, "sampling_session_seq_id": 999, "kind": "streaming",
        "type": "save_weights_for_sampler"})
    assert got.status_code == 400 and got.json()["category"] == "user" and "kind" in got.json()["error"], got.text
    session_id = tc.model_id.rpartition(":train:")[0]
    got = httpx.post(f"{stack.url}/api/v1/create_model", headers=headers, json={
        "session_id": session_id, "model_seq_id": 999, "base_model": "x", "lora_config": {"rank": 4},
        "optimizer_config": {"type": "lion"}, "type": "create_model"})
    assert got.status_code == 400 and "optimizer_config" in got.json()["error"], got.text
