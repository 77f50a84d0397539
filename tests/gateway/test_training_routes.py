"""Training routes on fake backends: what reaches the trainer, what the SDK gets back, and bad
bodies answered with a 400 that names the field."""

import numpy as np
import pytest

from gateway import tinker_wire_pb2 as tw
from gateway_fakes import assert_user_error, gateway  # noqa: F401 - the fixture


def _fwdbwd_body(model_id: str, seq_id: int, tokens: list[int]) -> bytes:
    req = tw.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy")
    datum = req.data.add()
    datum.model_input.add().encoded_text.tokens = np.asarray(tokens, "<i4").tobytes()
    targets = datum.loss_fn_inputs["target_tokens"]
    targets.dtype, targets.dense = tw.DTYPE_INT64, np.asarray(tokens[1:] + [0], "<i8").tobytes()
    return req.SerializeToString()


def test_create_model_reaches_the_trainer_with_its_lora_config(gateway):
    api = gateway.api
    model_id = api.model(api.session(), rank=4)
    (create,) = gateway.trainer.of("CreateModel")
    assert create.model_id == model_id and create.lora_config.rank == 4 and create.lora_config.train_mlp
    assert create.base_model == gateway.settings.base_model and not create.lora_config.HasField("seed")
    info = api.post("get_info", {"model_id": model_id}).json()
    assert info["model_data"]["model_name"] == "tiny/base" and info["lora_rank"] == 4
    # The tokenizer is named as the model was, not by the server's directory.
    assert info["model_data"]["tokenizer_id"] == "tiny/base"


def test_forward_backward_and_optim_step_in_seq_order(gateway):
    api = gateway.api
    model_id = api.model(api.session())
    headers = {"content-type": "application/x-protobuf"}
    fb = api.client.post("/api/v1/forward_backward", content=_fwdbwd_body(model_id, 1, [5, 6, 7]), headers=headers)
    step_body = {"model_id": model_id, "seq_id": 2, "type": "optim_step",
                 "adam_params": {"learning_rate": 0.5, "beta1": 0.8}}
    step = api.post("optim_step", step_body)
    assert api.post("optim_step", step_body).json() == step.json()   # a resend gets the same future
    # The same (model_id, seq_id) with another request is refused, not answered with the first's future.
    assert_user_error(api.post("optim_step", {"model_id": model_id, "seq_id": 2}), 400, "seq_id 2 was already used")
    assert_user_error(api.client.post("/api/v1/forward_backward", content=_fwdbwd_body(model_id, 2, [5, 6]),
                                      headers=headers), 400, "already used")
    from tinker.proto.response_conv import deserialize_forward_backward_output
    out = deserialize_forward_backward_output(api.result(fb.json()).content)
    assert np.allclose(out.loss_fn_outputs[0]["logprobs"].to_numpy(), [-0.05, -0.06, -0.07])
    assert api.result(step.json()).json()["metrics"] == {"step:max": 1.0}
    (sent,) = gateway.trainer.of("OptimStep")
    assert (sent.seq_id, sent.adam_params.learning_rate, sent.adam_params.beta1) == (2, 0.5, pytest.approx(0.8))
    assert [r.seq_id for r in gateway.trainer.of("ForwardBackward")] == [1]


@pytest.mark.parametrize("path, body, words", [
    ("create_model", {"session_id": "s", "lora_config": {"rank": "many"}}, ["lora_config.rank"]),
    ("create_model", [1, 2], ["valid dictionary"]),
    ("optim_step", {"model_id": "m", "seq_id": "x"}, ["seq_id"]),
    ("optim_step", {"model_id": "m", "adam_params": {"learning_rate": [1]}}, ["adam_params.learning_rate"]),
    ("save_weights", {"model_id": "m", "overwrite": "perhaps"}, ["overwrite"]),
    ("load_weights", {"path": 5}, ["path"]),
])
def test_a_body_that_does_not_fit_is_a_400_naming_the_field(gateway, path, body, words):
    assert_user_error(gateway.api.post(path, body), 400, *words)


def test_not_json_and_unknown_ids_are_user_errors(gateway):
    api = gateway.api
    r = api.client.post("/api/v1/create_session", content=b"{nope", headers={"content-type": "application/json"})
    assert_user_error(r, 400)
    assert_user_error(api.post("create_model", {"session_id": "sess-none", "base_model": "tiny/base"}), 404,
                      "unknown session_id")
    assert_user_error(api.post("optim_step", {"model_id": "nobody:train:0"}), 404, "unknown model_id")
    session = api.session()
    assert_user_error(api.post("create_model", {"session_id": session, "base_model": "other"}), 400, "not supported")
    assert_user_error(api.post("optim_step", {"model_id": api.model(session), "adam_params": {"type": "sgd"}}), 400,
                      "not supported")


def test_a_trainer_refusal_fails_the_future_as_a_user_error_and_leaves_no_run(gateway):
    api = gateway.api
    body = {"session_id": api.session(), "base_model": "tiny/base", "lora_config": {"rank": 999}}
    assert_user_error(api.post("create_model", body), 400, "--max-lora-rank 64")      # refused at the edge
    gateway.settings.max_lora_rank = 10_000                                           # so the trainer refuses
    future = api.post("create_model", body).json()
    failed = api.result(future).json()
    assert failed["category"] == "user" and "rank" in failed["error"]
    assert_user_error(api.post("get_info", {"model_id": future["model_id"]}), 404)
    assert api.get("training_runs").json()["training_runs"] == []


def test_a_closed_session_refuses_training_and_its_heartbeat_is_410(gateway):
    api = gateway.api
    session = api.session()
    model_id = api.model(session)
    assert api.post(f"sessions/{session}/finish", {}).status_code == 200
    assert_user_error(api.post("session_heartbeat", {"session_id": session}), 410)
    assert_user_error(api.post("optim_step", {"model_id": model_id, "seq_id": 1}), 400, "closed")


def test_a_request_refused_at_the_edge_leaves_no_gap_in_the_models_order(gateway):
    """The SDK gave the refused request a seq_id: it is recorded as refused (the trainer told by
    SkipSeq), so the next request runs at once instead of waiting out the gap timeout twice
    (this gateway's runner, then the trainer's order: 10 s each)."""
    import time

    api = gateway.api
    model_id = api.model(api.session())
    headers = {"content-type": "application/x-protobuf"}
    bad = tw.ForwardBackwardRequest(model_id=model_id, seq_id=1, loss_fn="cross_entropy")
    bad.ParseFromString(_fwdbwd_body(model_id, 1, [5, 6, 7]))
    weights = bad.data[0].loss_fn_inputs["weights"]          # 2 values for 3 tokens
    weights.dtype, weights.dense = tw.DTYPE_FLOAT32, np.asarray([1, 1], "<f4").tobytes()
    refused = api.client.post("/api/v1/forward_backward", content=bad.SerializeToString(), headers=headers)
    assert_user_error(refused, 400, "leading dimension 3")
    t0 = time.monotonic()
    step = api.post("optim_step", {"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 0.1}})
    assert api.result(step.json()).status_code == 200
    assert time.monotonic() - t0 < 5, "the next request waited for the refused seq_id"
    assert [(r.model_id, r.seq_id) for r in gateway.trainer.of("SkipSeq")] == [(model_id, 1)]
    # A resend of the refused request is refused again, the same way.
    again = api.client.post("/api/v1/forward_backward", content=bad.SerializeToString(), headers=headers)
    assert_user_error(again, 400, "leading dimension 3")
