"""The unmodified SDK 0.38 against `tinkerd up --sample-session-poll`, told by client/config and
dynamic_config to batch its sample polls (retrieve_futures) and to cancel what it abandons
(cancel_future): it does both, and its samples come back the same as through the per-request
path. Without the flag (the default) it long-polls each sample alone. The gateway's
/internal/futures_stats counts which routes served it."""

from __future__ import annotations

import sqlite3
import time

import httpx
import pytest
import tinker
from tinker import types
from tinker.proto.response_conv import deserialize_sample_response

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def polled(tiny_model_dir, tmp_path_factory, start_stack):
    """A stack that tells the SDK to poll its sampling sessions (the shared `stack` does not)."""
    with start_stack(tiny_model_dir, tmp_path_factory.mktemp("state"), "--sample-session-poll") as s:
        yield s

PROMPTS = [[5 + i, 9 + 2 * i, 17 + 3 * i] for i in range(12)]


def _headers(stack) -> dict:
    return {"X-API-Key": stack.api_key}


def _calls(stack) -> dict:
    r = httpx.get(f"{stack.internal_url}/internal/futures_stats", headers=_headers(stack))   # an admin's key
    assert r.status_code == 200, r.text
    return r.json()["calls"]


def _delta(before: dict, after: dict, key: str) -> int:
    return after.get(key, 0) - before.get(key, 0)


def _per_request_path(stack, sampling_session_id: str, seq_id: int, prompt: list[int], params: dict):
    """The same sample without the SDK: asample, then one retrieve_future long-poll."""
    body = {"sampling_session_id": sampling_session_id, "seq_id": seq_id, "num_samples": 2,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]}, "sampling_params": params}
    future = httpx.post(f"{stack.url}/api/v1/asample", json=body, headers=_headers(stack), timeout=60).json()
    r = httpx.post(f"{stack.url}/api/v1/retrieve_future", json={"request_id": future["request_id"]},
                   headers={**_headers(stack), "Accept": "application/x-protobuf"}, timeout=60)
    assert r.status_code == 200, r.text
    return deserialize_sample_response(r.content)


def _greedy_samples(stack, model_dir: str):
    """PROMPTS sampled at once (2 greedy sequences of 6 tokens each) by one SDK sampling client:
    (the client, its results, the gateway's route counts before and after)."""
    sampler = tinker.ServiceClient(base_url=stack.url).create_sampling_client(base_model=model_dir).result()
    greedy = types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])
    before = _calls(stack)
    futures = [sampler.sample(types.ModelInput.from_ints(p), 2, greedy) for p in PROMPTS]
    results = [f.result(timeout=300) for f in futures]
    return sampler, results, before, _calls(stack)


def test_without_the_flag_the_sdk_long_polls_each_sample_alone(stack, tiny_model_dir):
    _, results, before, after = _greedy_samples(stack, tiny_model_dir)
    assert all(len(r.sequences) == 2 and all(len(s.tokens) == 6 for s in r.sequences) for r in results)
    # One long-poll each, answered when its sample finished (a try-again only after 25 s).
    assert _delta(before, after, "retrieve_future") == len(PROMPTS)
    assert _delta(before, after, "retrieve_futures") == 0


def test_the_sdk_polls_its_samples_in_one_batch(polled, tiny_model_dir):
    stack = polled
    sampler, results, before, after = _greedy_samples(stack, tiny_model_dir)

    # One payload fetch per sample (never a long-poll: the batch poll said it was done), and the
    # batch polls reported every sample; fewer polls than samples (here usually one or two).
    assert _delta(before, after, "retrieve_future") == len(PROMPTS)
    assert _delta(before, after, "completions_reported") >= len(PROMPTS)
    assert 1 <= _delta(before, after, "retrieve_futures") <= len(PROMPTS) + 2

    # The same samples through the per-request path: the same greedy tokens.
    params = {"max_tokens": 6, "temperature": 0.0, "stop": []}
    for i, (prompt, got) in enumerate(zip(PROMPTS, results)):
        want = _per_request_path(stack, sampler._sampling_session_id, 10_000 + i, prompt, params)
        assert [s.tokens for s in got.sequences] == [list(s.tokens) for s in want.sequences]
        assert all(len(s.tokens) == 6 and len(s.logprobs) == 6 for s in got.sequences)


def test_abandoned_samples_are_cancelled(polled, tiny_model_dir):
    stack = polled
    service = tinker.ServiceClient(base_url=stack.url)
    sampler = service.create_sampling_client(base_model=tiny_model_dir).result()
    long = types.SamplingParams(max_tokens=1000, temperature=1.0, stop=[], seed=3)
    before = _calls(stack)
    futures = [sampler.sample(types.ModelInput.from_ints(p), 4, long) for p in PROMPTS[:8]]
    deadline = time.monotonic() + 60             # submitted: the SDK's batch poll is waiting for them
    while _delta(before, _calls(stack), "retrieve_futures") == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)
    for f in futures:
        f.future().cancel()                        # abandon: the SDK sends cancel_future
    deadline = time.monotonic() + 60
    while _delta(before, _calls(stack), "cancelled") == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    after = _calls(stack)
    assert _delta(before, after, "cancel_future") >= 1 and _delta(before, after, "cancelled") >= 1

    # A cancelled future's result, asked for anyway, is a user error that says so.
    with sqlite3.connect(f"{stack.state_dir}/tinkerd.db") as db:
        cancelled = [rid for (rid,) in db.execute(
            "SELECT request_id FROM futures WHERE request_type = 'sample' "
            "AND CAST(result AS TEXT) LIKE '%cancel_future%'")]
    assert cancelled
    r = httpx.post(f"{stack.url}/api/v1/retrieve_future", json={"request_id": cancelled[-1]},
                   headers=_headers(stack), timeout=60)
    assert r.status_code == 200 and r.json()["category"] == "user" and "cancelled" in r.json()["error"], r.text

    # The sampler still serves the same client afterwards.
    short = types.SamplingParams(max_tokens=3, temperature=0.0)
    assert len(sampler.sample(types.ModelInput.from_ints(PROMPTS[0]), 1, short).result(timeout=300)
               .sequences[0].tokens) == 3
