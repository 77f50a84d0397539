"""Bad input at the edge (issue 12), on fake backends: each is a 4xx with the Tinker error body
naming what is wrong, and none reaches the trainer or the sampler."""

import json

import numpy as np
import pytest
import zstandard

from gateway import tinker_wire_pb2 as tw
from gateway_fakes import assert_user_error, gateway  # noqa: F401 - the fixture

NAN, INF = float("nan"), float("inf")


def _post_raw(api, path: str, raw: bytes, **headers):
    return api.client.post(f"/api/v1/{path}", content=raw, headers={"content-type": "application/json", **headers})


@pytest.mark.parametrize("adam, field", [
    ({"learning_rate": NAN}, "learning_rate"), ({"learning_rate": INF}, "learning_rate"),
    ({"learning_rate": -1e-3}, "learning_rate"), ({"beta1": 1.0}, "beta1"), ({"beta2": -0.1}, "beta2"),
    ({"eps": 0.0}, "eps"), ({"weight_decay": -INF}, "weight_decay"), ({"grad_clip_norm": NAN}, "grad_clip_norm"),
])
def test_optim_step_refuses_numbers_adam_cannot_use(gateway, adam, field):
    api = gateway.api
    model_id = api.model(api.session())
    body = json.dumps({"model_id": model_id, "seq_id": 1, "adam_params": adam}).encode()   # NaN as JSON's NaN
    assert_user_error(_post_raw(api, "optim_step", body), 400, field)
    assert gateway.trainer.of("OptimStep") == []


@pytest.mark.parametrize("edit, field", [
    ({"sampling_params": {"temperature": NAN}}, "temperature"),
    ({"sampling_params": {"temperature": 1e30}}, "temperature"),
    ({"sampling_params": {"top_p": 0}}, "top_p"),
    ({"sampling_params": {"max_tokens": 0}}, "max_tokens"),
    ({"sampling_params": {"stop": ""}}, "stop"), ({"sampling_params": {"stop": ["a", ""]}}, "stop"),
    ({"sampling_params": {"stop": [-1]}}, "stop"), ({"sampling_params": {"stop": [1, "a"]}}, "stop"),
    ({"sampling_params": {"seed": 2**70}}, "seed"),
    ({"topk_sample_logprobs": 1_000_000}, "topk_sample_logprobs"),
    ({"topk_prompt_logprobs": 21}, "topk_prompt_logprobs"),
    ({"num_samples": 0}, "num_samples"), ({"num_samples": 10**6}, "num_samples"),
    ({"seq_id": 2**64}, "seq_id"), ({"seq_id": -1}, "seq_id"),
    ({"prompt": {"chunks": [{"tokens": [1, -5]}]}}, "prompt.chunks.0.tokens.1"),
    ({"sampling_session_id": "\ud800"}, "sampling_session_id"),
])
def test_asample_refuses_what_the_engine_cannot_take(gateway, edit, field):
    api = gateway.api
    session = api.session()
    sid = api.post("create_sampling_session", {"session_id": session, "base_model": "tiny/base"}).json()
    body = {"sampling_session_id": sid["sampling_session_id"], "seq_id": 0,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]}, "sampling_params": {"max_tokens": 2}}
    for key, value in edit.items():
        body[key] = {**body[key], **value} if isinstance(value, dict) and key == "sampling_params" else value
    assert_user_error(_post_raw(api, "asample", json.dumps(body).encode()), 400, field)
    assert gateway.sampler.requests == []


@pytest.mark.parametrize("path, body, field", [
    ("create_model", {"session_id": "s", "model_seq_id": 2**64}, "model_seq_id"),
    ("create_model", {"session_id": "s", "lora_config": {"rank": 0}}, "lora_config.rank"),
    ("create_model", {"session_id": "s", "lora_config": {"seed": 10**30}}, "seed"),
    ("create_session", {"user_metadata": {"a": [1, NAN]}}, "user_metadata.a.1"),
    ("create_session", {"user_metadata": {"blob": "x" * 100_000}}, "user_metadata"),
    ("create_session", {"user_metadata": {"a\u0000": 1}}, "user_metadata"),
    ("create_session", {"tags": ["x"] * 1000}, "tags"),
    ("save_weights", {"model_id": "m", "ttl_seconds": 10**30}, "ttl_seconds"),
    ("save_weights_for_sampler", {"model_id": "m", "seq_id": 2**63}, "seq_id"),
    ("load_weights", {"path": "tinker://a/weights/b", "model_seq_id": -1}, "model_seq_id"),
    ("weights_info", {"tinker_path": "a\u0000b"}, "tinker_path"),
    ("copy_weights", {"source_path": "x", "ttl_seconds": 0}, "ttl_seconds"),
    ("retrieve_future", {"request_id": "\ud800"}, "request_id"),
    ("session_heartbeat", {"session_id": ["x"]}, "session_id"),
])
def test_numbers_and_strings_out_of_range_are_400s_naming_the_field(gateway, path, body, field):
    assert_user_error(_post_raw(gateway.api, path, json.dumps(body).encode()), 400, field)


@pytest.mark.parametrize("name", ["..", ".", ".hidden", "a/b", "a\u0000b", "x" * 256, ""])
def test_checkpoint_names_never_leave_their_directory(gateway, name):
    api = gateway.api
    model_id = api.model(api.session())
    for route in ("save_weights", "save_weights_for_sampler", "save_weights_external"):
        r = api.post(route, {"model_id": model_id, "seq_id": 1, "path": name})
        assert_user_error(r, 400, "path")
    assert gateway.trainer.of("SaveState") == [] and gateway.trainer.of("PushWeights") == []


def test_the_registry_refuses_offsets_beyond_64_bits(gateway):
    assert_user_error(gateway.api.get("training_runs", params={"offset": 2**64}), 400, "offset")
    assert_user_error(gateway.api.get("checkpoints", params={"limit": "NaN"}), 400, "limit")


# ---- bodies that are not JSON, or too big -------------------------------------------------

@pytest.mark.parametrize("raw, words", [
    (b'{"session_id": "\xff\xfe"}', ["UTF-8"]),
    (b"[" * 100_000 + b"]" * 100_000, ["nested too deeply"]),
    (b'{"model_seq_id": ' + b"9" * 5000 + b"}", ["not valid JSON"]),
    (b'{"session_id": ', ["JSON"]),
])
def test_bodies_that_are_not_json_are_400s_in_the_tinker_error_body(gateway, raw, words):
    assert_user_error(_post_raw(gateway.api, "create_model", raw), 400, *words)


def test_a_body_over_the_limit_is_a_413_before_it_is_read(gateway):
    big = json.dumps({"user_metadata": {"blob": "x" * (gateway.settings.max_body_bytes + 1)}}).encode()
    assert_user_error(_post_raw(gateway.api, "create_session", big), 413, "at most")


def test_a_chunked_body_over_the_limit_is_a_413(gateway):
    limit = gateway.settings.max_body_bytes

    def chunks():
        for _ in range(limit // (1 << 20) + 2):
            yield b" " * (1 << 20)
    r = gateway.api.client.post("/api/v1/create_session", content=chunks(), headers={"content-type": "application/json"})
    assert_user_error(r, 413, "over")


def test_a_zstd_bomb_is_a_413_and_zstd_garbage_a_400(gateway):
    bomb = zstandard.ZstdCompressor(level=19).compress(b"\0" * (gateway.settings.max_body_bytes + 1))
    assert len(bomb) < 10_000
    headers = {"content-type": "application/x-protobuf", "content-encoding": "zstd"}
    r = gateway.api.client.post("/api/v1/forward_backward", content=bomb, headers=headers)
    assert_user_error(r, 413, "inflates")
    r = gateway.api.client.post("/api/v1/forward_backward", content=b"\x28\xb5\x2f\xfd garbage", headers=headers)
    assert_user_error(r, 400, "zstd")
    assert gateway.trainer.of("ForwardBackward") == []


def test_unknown_routes_answer_in_the_tinker_error_body(gateway):
    assert_user_error(gateway.api.get("no_such_route"), 404)


# ---- forward_backward's protobuf ----------------------------------------------------------

def _fwdbwd(model_id: str, edit) -> bytes:
    req = tw.ForwardBackwardRequest(model_id=model_id, seq_id=1, loss_fn="cross_entropy")
    datum = req.data.add()
    datum.model_input.add().encoded_text.tokens = np.asarray([5, 6, 7], "<i4").tobytes()
    targets = datum.loss_fn_inputs["target_tokens"]
    targets.dtype, targets.dense = tw.DTYPE_INT64, np.asarray([6, 7, 0], "<i8").tobytes()
    weights = datum.loss_fn_inputs["weights"]
    weights.dtype, weights.dense = tw.DTYPE_FLOAT32, np.ones(3, "<f4").tobytes()
    edit(req, datum, weights)
    return req.SerializeToString()


def _sparse(shape, crow, col, values):
    return tw.Tensor(dtype=tw.DTYPE_FLOAT32, shape=shape, sparse_csr=tw.SparseCsr(
        crow_indices=np.asarray(crow, "<i8").tobytes(), col_indices=np.asarray(col, "<i8").tobytes(),
        values=np.asarray(values, "<f4").tobytes()))


BAD_PROTOBUF = {
    "odd token bytes": (lambda r, d, w: setattr(d.model_input[0].encoded_text, "tokens", b"\1\2\3"), "int32"),
    "negative token": (lambda r, d, w: setattr(d.model_input[0].encoded_text, "tokens",
                                               np.asarray([-1], "<i4").tobytes()), "negative"),
    "unknown dtype": (lambda r, d, w: setattr(w, "dtype", 77), "dtype"),
    "odd dense bytes": (lambda r, d, w: setattr(w, "dense", b"\1\2\3\4\5"), "4-byte"),
    "overflowing shape": (lambda r, d, w: w.shape.extend([2**62, 2**62]), "shape"),
    "two unknown dims": (lambda r, d, w: w.shape.extend([-1, -3]), "negative"),
    "NaN input": (lambda r, d, w: setattr(w, "dense", np.asarray([1, NAN, 1], "<f4").tobytes()), "NaN"),
    "NaN config": (lambda r, d, w: r.loss_fn_config.update({"clip": NAN}), "loss_fn_config"),
    "negative seq_id": (lambda r, d, w: setattr(r, "seq_id", -3), "seq_id"),
    "too many datums": (lambda r, d, w: [r.data.add().CopyFrom(d) for _ in range(1024)], "datums"),
    "sparse cols out of range": (lambda r, d, w: w.CopyFrom(_sparse([3, 2], [0, 1, 1, 2], [-7, 1], [1, 1])),
                                 "sparse"),
    "sparse rows backwards": (lambda r, d, w: w.CopyFrom(_sparse([3, 2], [0, 2, 1, 2], [0, 1], [1, 1])), "sparse"),
    "huge sparse": (lambda r, d, w: w.CopyFrom(_sparse([3, 2**40], [0, 0, 0, 0], [], [])), "bytes in all once dense"),
    "image chunk": (lambda r, d, w: d.model_input.add().image.SetInParent(), "image"),
}


@pytest.mark.parametrize("case", list(BAD_PROTOBUF))
def test_malformed_forward_backward_protobuf_is_a_400(gateway, case):
    edit, words = BAD_PROTOBUF[case]
    api = gateway.api
    model_id = api.model(api.session())
    r = api.client.post("/api/v1/forward_backward", content=_fwdbwd(model_id, edit),
                        headers={"content-type": "application/x-protobuf"})
    assert_user_error(r, 400, words)
    assert gateway.trainer.of("ForwardBackward") == []


def test_a_zstd_forward_backward_within_the_limit_still_works(gateway):
    api = gateway.api
    model_id = api.model(api.session())
    body = zstandard.ZstdCompressor().compress(_fwdbwd(model_id, lambda r, d, w: None))
    r = api.client.post("/api/v1/forward_backward", content=body,
                        headers={"content-type": "application/x-protobuf", "content-encoding": "zstd"})
    assert r.status_code == 200, r.text
    assert api.result(r.json()).status_code == 200
    (sent,) = gateway.trainer.of("ForwardBackward")
    assert list(sent.data[0].tokens) == [5, 6, 7]
