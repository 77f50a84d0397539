"""Sampling routes on fake backends: JSON sampling params become the sampler's request, its
reply becomes the SDK's SampleResponse, and bad input is a 400 before anything is queued."""

import asyncio

import numpy as np
import pytest

from gateway_fakes import assert_user_error, gateway  # noqa: F401 - the fixture
from tinkerd.v1 import sampler_pb2

_Stop = sampler_pb2.SamplingParams.StopMode


def _sampling_session(api) -> str:
    body = {"session_id": api.session(), "sampling_session_seq_id": 0, "base_model": "tiny/base"}
    return api.post("create_sampling_session", body).json()["sampling_session_id"]


def _sample(api, sid: str, seq_id: int = 0, **fields):
    body = {"sampling_session_id": sid, "seq_id": seq_id, "num_samples": 2,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [3, 4, 5]}]},
            "sampling_params": {"max_tokens": 2, "temperature": 0.5}, **fields}
    return api.post("asample", body)


@pytest.mark.parametrize("stop, mode, strings, tokens", [
    (None, _Stop.STOP_MODE_DEFAULT, [], []),
    ([], _Stop.STOP_MODE_NONE, [], []),
    ("\n", _Stop.STOP_MODE_STRINGS, ["\n"], []),
    (["a", "b"], _Stop.STOP_MODE_STRINGS, ["a", "b"], []),
    ([7, 9], _Stop.STOP_MODE_TOKENS, [], [7, 9]),
])
def test_stop_forms_reach_the_sampler(gateway, stop, mode, strings, tokens):
    api = gateway.api
    r = _sample(api, _sampling_session(api), sampling_params={"max_tokens": 2, "stop": stop})
    api.result(r.json())
    params = gateway.sampler.requests[-1].params
    assert (params.stop_mode, list(params.stop_strings), list(params.stop_token_ids)) == (mode, strings, tokens)


def test_a_sample_comes_back_in_the_sdk_format(gateway):
    from tinker.proto.response_conv import deserialize_sample_response

    api = gateway.api
    future = _sample(api, _sampling_session(api), prompt_logprobs=True, topk_prompt_logprobs=2).json()
    assert future["sample_sequence_ids"] == [f"{future['request_id']}:{i}" for i in range(2)]
    out = deserialize_sample_response(api.result(future).content)
    assert [s.tokens for s in out.sequences] == [[5, 4], [5, 4]] and out.sequences[0].logprobs == [-1.0, -1.0]
    sent = gateway.sampler.requests[-1]
    assert list(sent.prompt_tokens) == [3, 4, 5] and sent.num_samples == 2 and sent.prompt_logprobs
    assert sent.topk_prompt_logprobs == 2 and sent.params.temperature == 0.5 and sent.snapshot_id == ""


def test_target_prompt_logprobs_reach_the_sampler_in_their_layout(gateway):
    api = gateway.api
    target = {"data": [9], "dtype": "int64", "shape": [2, 4], "sparse_crow_indices": [0, 0, 1],
              "sparse_col_indices": [3]}
    api.result(_sample(api, _sampling_session(api), target_prompt_logprobs=target).json())
    sent = gateway.sampler.requests[-1].prompt_target_ids
    assert list(sent.shape) == [2, 4] and np.frombuffer(sent.data, "<i8").tolist() == [9]
    assert np.frombuffer(sent.sparse_csr.crow_indices, "<i8").tolist() == [0, 0, 1]


def test_a_resent_sample_gets_the_first_future(gateway):
    api = gateway.api
    sid = _sampling_session(api)
    assert _sample(api, sid, 3).json() == _sample(api, sid, 3).json()


@pytest.mark.parametrize("fields, words", [
    ({"num_samples": 0}, ["num_samples"]),
    ({"sampling_params": {"stop": [1, "a"]}}, ["sampling_params.stop"]),
    ({"sampling_params": {"temperature": "hot"}}, ["sampling_params.temperature"]),
    ({"prompt": {"chunks": [{"type": "image", "data": "x"}]}}, ["image"]),
    ({"prompt_alt_tokens_k": 2}, ["prompt_alt_tokens_k"]),
    ({"target_prompt_logprobs": {"data": [4, 5, 6], "dtype": "int64", "shape": [3, 1]}},
     ["target_prompt_logprobs", "[2, K]"]),
    ({"target_prompt_logprobs": {"data": [-1, -1], "dtype": "int64", "shape": [2, 1]}},
     ["target_prompt_logprobs", "names no token id"]),
    ({"prompt_logprobs_last_n": 1}, ["prompt_logprobs_last_n", "set prompt_logprobs"]),
])
def test_bad_sample_requests_are_refused_before_queueing(gateway, fields, words):
    api = gateway.api
    assert_user_error(_sample(api, _sampling_session(api), **fields), 400, *words)
    assert gateway.sampler.requests == []


def test_unknown_ids(gateway):
    api = gateway.api
    assert_user_error(_sample(api, "sess-x:sample:0"), 404, "unknown sampling_session_id")
    assert_user_error(api.get("samplers/sess-x:sample:0"), 404)
    assert_user_error(api.post("retrieve_future", {"request_id": "nope"}), 404)
    body = {"session_id": api.session(), "model_path": "tinker://r:train:0/sampler_weights/x"}
    assert_user_error(api.post("create_sampling_session", body), 404, "unknown checkpoint")


def test_retrieve_future_bad_bodies(gateway):
    api = gateway.api
    assert_user_error(api.post("retrieve_future", {"request_id": 5}), 400, "request_id")
    r = api.client.post("/api/v1/retrieve_future", content=b"{x", headers={"content-type": "application/json"})
    assert_user_error(r, 400, "not valid JSON")


def test_a_sampling_session_id_taken_mid_push_is_a_user_error_not_a_500(gateway):
    """The fuzz's race: save_weights_for_sampler found its sampling session id free, and while
    the weights were pushed a create_sampling_session took it. The save fails as a 400 that says
    why; the concurrent session is left as it was; a create resent as it was is answered again."""
    api = gateway.api
    session = api.session()
    model = api.model(session)
    taken = {"session_id": session, "sampling_session_seq_id": 1, "base_model": "tiny/base"}
    trainer = api.client.app.state.gateway.trainer
    push = trainer.PushWeights

    async def push_while_taken(request):
        reply = await push(request)
        made = await asyncio.to_thread(api.post, "create_sampling_session", taken)     # as a concurrent request
        assert made.status_code == 200
        return reply
    trainer.PushWeights = push_while_taken
    try:
        future = api.post("save_weights_for_sampler", {"model_id": model, "seq_id": 1, "sampling_session_seq_id": 1})
        failed = api.result(future.json()).json()
        assert failed["category"] == "user" and "created meanwhile" in failed["error"], failed
    finally:
        trainer.PushWeights = push
    again = api.post("create_sampling_session", taken)
    assert again.json()["sampling_session_id"] == f"{session}:sample:1"
    assert api.get(f"samplers/{session}:sample:1").json()["model_path"] is None


def test_inflight_clients_sample_the_newest_inflight_save_in_their_own_cache_namespace(gateway):
    """An inflight save is written to disk only (no replica push) and becomes its model's target;
    every inflight client samples the newest target, each in a prefix-cache namespace of its own
    (vLLM's cache_salt); a snapshot client samples its own snapshot with the cache shared."""
    api = gateway.api
    model_id = api.model(api.session())

    def save(seq_id: int, ss_seq: int, kind: str) -> tuple[str, str]:
        r = api.post("save_weights_for_sampler", {"model_id": model_id, "seq_id": seq_id,
                                                  "sampling_session_seq_id": ss_seq, "kind": kind})
        assert r.status_code == 200, r.text
        sid = api.result(r.json()).json()["sampling_session_id"]
        return sid, gateway.trainer.of("PushWeights")[-1]

    first, push = save(1, 0, "inflight")
    assert list(push.sampler_addresses) == [] and not push.copy_in_background
    snapshot, snap_push = save(2, 1, "snapshot")
    second, newest = save(3, 2, "inflight")

    def sampled(sid: str) -> sampler_pb2.SampleRequest:
        r = api.post("asample", {"sampling_session_id": sid, "seq_id": 0, "num_samples": 1,
                                 "prompt": {"chunks": [{"type": "encoded_text", "tokens": [3, 4]}]}})
        assert api.result(r.json()).status_code == 200
        return gateway.sampler.requests[-1]
    for sid in (first, second):
        request = sampled(sid)
        assert (request.snapshot_id, request.cache_namespace) == (newest.snapshot_id, sid)
    request = sampled(snapshot)
    assert (request.snapshot_id, request.cache_namespace) == (snap_push.snapshot_id, "")


def test_join_sampling_session_gives_each_clone_its_own_id(gateway):
    """SDK 0.38 (client/config sample_join_sampling_session): an unpickled SamplingClient asks for
    its clone id; each is new in its sampling session (1, 2, ...: the original is 0), another user's
    sampling session is unknown."""
    api = gateway.api
    assert api.post("client/config", {"sdk_version": "0.38.0"}).json()["sample_join_sampling_session"] is True
    sid = api.post("create_sampling_session", {"session_id": api.session(), "sampling_session_seq_id": 0,
                                               "base_model": "tiny/base"}).json()["sampling_session_id"]
    ids = [api.post("join_sampling_session", {"sampling_session_id": sid}).json() for _ in range(3)]
    assert ids == [{"type": "join_sampling_session", "client_counter": n} for n in (1, 2, 3)]
    assert_user_error(api.as_user("mallory").post("join_sampling_session", {"sampling_session_id": sid}), 404)
    assert_user_error(api.post("join_sampling_session", {}), 400, "sampling_session_id")
