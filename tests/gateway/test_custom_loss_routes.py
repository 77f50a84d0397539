"""create_custom_loss on fake backends: the capability advertised, a traced loss (by the real SDK's
tracer) stored and sent to the trainer with forward_backward, and bad graphs refused with a 400
that names the problem."""

import copy

import numpy as np
import pytest
import torch
from sqlalchemy import select
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

from gateway import tinker_wire_pb2 as tw
from gateway_fakes import assert_user_error, gateway  # noqa: F401 - the fixture
from tinkerd import custom_loss


def ppo_loss(logprobs, old_logprobs, advantages):
    ratio = torch.exp(logprobs - old_logprobs)
    loss = -torch.minimum(ratio * advantages, torch.clamp(ratio, 0.8, 1.2) * advantages).sum()
    return loss, {"custom/ratio:mean": ratio.mean()}


RANKS = {"logprobs": 1, "old_logprobs": 1, "advantages": 1}


def upload(session_id: str, seq: int = 0, fn=ppo_loss, ranks=RANKS) -> dict:
    """The SDK's CreateCustomLossRequest body for `fn`."""
    handle = trace_loss(fn, ranks, session_id)
    return {"session_id": session_id, "custom_loss_seq_id": seq, "name": handle.name,
            "inputs": [i.model_dump() for i in handle.inputs],
            "graph": encode_graph(handle).model_dump(mode="json"), "type": "create_custom_loss"}


def _fwdbwd(model_id: str, seq_id: int, loss_id: str | None, inputs=("old_logprobs", "advantages")) -> bytes:
    req = tw.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="custom")
    if loss_id is not None:
        req.loss_fn_config_v2["loss_id"].text = loss_id
    tokens = [5, 6, 7]
    datum = req.data.add()
    datum.model_input.add().encoded_text.tokens = np.asarray(tokens, "<i4").tobytes()
    targets = datum.loss_fn_inputs["target_tokens"]
    targets.dtype, targets.dense = tw.DTYPE_INT64, np.asarray([6, 7, 0], "<i8").tobytes()
    for key in inputs:
        t = datum.loss_fn_inputs[key]
        t.dtype, t.dense = tw.DTYPE_FLOAT32, np.asarray([0.1, -0.2, 0.3], "<f4").tobytes()
    return req.SerializeToString()


def _post_fb(api, body: bytes):
    return api.client.post("/api/v1/forward_backward", content=body,
                           headers={"content-type": "application/x-protobuf"})


def test_the_capability_is_advertised(gateway):
    assert gateway.api.post("client/config", {}).json()["custom_loss_server_side"] is True


def test_a_loss_is_stored_and_forward_backward_carries_it_to_the_trainer(gateway):
    api = gateway.api
    session = api.session()
    model_id = api.model(session)
    future = api.post("create_custom_loss", upload(session)).json()
    created = api.result(future).json()
    loss_id = created["loss_id"]
    assert created["type"] == "create_custom_loss" and loss_id == f"{session}:loss:0"
    # A resend of the same request gets the same answer; the seq_id with another graph is refused.
    assert api.post("create_custom_loss", upload(session)).json()["request_id"] == future["request_id"]

    def other(logprobs, old_logprobs, advantages):
        return -(logprobs * advantages).sum(), {}
    assert_user_error(api.post("create_custom_loss", upload(session, fn=other)), 400, "custom_loss_seq_id 0",
                      "already used")

    r = _post_fb(api, _fwdbwd(model_id, 1, loss_id))
    assert r.status_code == 200, r.json()
    api.result(r.json())
    (sent,) = gateway.trainer.of("ForwardBackward")
    assert sent.loss_fn == "custom" and sent.custom_loss.loss_id == loss_id
    spec = custom_loss.from_canonical(sent.custom_loss.spec_json)
    assert spec.name == "ppo_loss" and spec.input_names == ("old_logprobs", "advantages")
    assert spec.metric_keys == ("custom/ratio:mean",)


def test_forward_backward_with_a_custom_loss_is_checked_at_the_edge(gateway):
    api = gateway.api
    session = api.session()
    model_id = api.model(session)
    loss_id = api.result(api.post("create_custom_loss", upload(session)).json()).json()["loss_id"]
    assert_user_error(_post_fb(api, _fwdbwd(model_id, 1, None)), 400, "loss_id")
    assert_user_error(_post_fb(api, _fwdbwd(model_id, 1, f"{session}:loss:9")), 404, "unknown custom loss")
    assert_user_error(_post_fb(api, _fwdbwd(model_id, 1, loss_id, inputs=("old_logprobs",))), 400,
                      "no 'advantages'", "ppo_loss")
    # Another session's model cannot use it; another user does not see it at all.
    other_model = api.model(api.session())
    assert_user_error(_post_fb(api, _fwdbwd(other_model, 1, loss_id)), 400, "only be used by models of that session")
    stranger = api.as_user("stranger")
    stranger_model = stranger.model(stranger.session())
    r = stranger.client.post("/api/v1/forward_backward", content=_fwdbwd(stranger_model, 1, loss_id),
                             headers={"content-type": "application/x-protobuf", "X-API-Key": stranger.api_key})
    assert_user_error(r, 404, "unknown custom loss")
    assert gateway.trainer.of("ForwardBackward") == []


def _nodes(body: dict) -> list:
    return body["graph"]["nodes"]


def _with(mutate):
    def make(session):
        body = copy.deepcopy(upload(session))
        mutate(body)
        return body
    return make


def _node(body, name):
    return next(n for n in _nodes(body) if n["name"] == name)


BAD_GRAPHS = [
    # an op outside the whitelist, by function or by method
    (_with(lambda b: _node(b, "exp").update(target="os.system")), ["'os.system'", "not allowed"]),
    (_with(lambda b: _node(b, "exp").update(target="builtins.eval")), ["'builtins.eval'", "not allowed"]),
    (_with(lambda b: _node(b, "exp").update(op="call_method", target="backward")), ["method 'backward'"]),
    (_with(lambda b: _node(b, "exp").update(op="call_module", target="loss")), ["call_module nodes are not allowed"]),
    (_with(lambda b: _node(b, "exp").update(op="get_attr", target="weights")), ["get_attr nodes are not allowed"]),
    (_with(lambda b: _node(b, "exp").update(op="exec")), ["unknown node op 'exec'"]),
    # wrong arity, unknown keywords
    (_with(lambda b: _node(b, "exp")["args"].append(1.0)), ["torch.exp takes 1 positional arguments, got 2"]),
    (_with(lambda b: _node(b, "clamp")["kwargs"].update(out={"ref": "exp"})), ["no keyword argument 'out'"]),
    # references: unknown, forward (a cycle), self
    (_with(lambda b: _node(b, "exp")["args"].__setitem__(0, {"ref": "nowhere"})), ["'nowhere'", "no earlier node"]),
    (_with(lambda b: _node(b, "sub").update(args=[{"ref": "exp"}, {"ref": "old_logprobs"}])),
     ["'exp'", "cycle"]),
    (_with(lambda b: _node(b, "exp").update(name="sub")), ["name is used by an earlier node"]),
    # inputs and outputs
    (_with(lambda b: b["inputs"].__setitem__(0, {"name": "logprobs", "rank": 2})), ["logprobs must have rank 1"]),
    (_with(lambda b: b["inputs"].__setitem__(1, {"name": "old_logprobs", "rank": 5})), ["rank 5"]),
    (_with(lambda b: _nodes(b).pop()), ["last node must be its output"]),
    (_with(lambda b: _nodes(b)[-1]["args"].__setitem__(0, {"ref": "exp"})), ["must return (loss, metrics)"]),
    # shapes: every datum would hit these
    (_with(lambda b: b["inputs"].__setitem__(1, {"name": "old_logprobs", "rank": 2})),
     ["node sub (operator.sub): shapes [T] and [T, K] do not broadcast"]),
    (_with(lambda b: _nodes(b)[-1]["args"][0]["tuple"].__setitem__(0, {"ref": "exp"})),
     ["returns a loss of shape [T]; it must be a scalar"]),
    # constants that are not data
    (_with(lambda b: _node(b, "clamp")["args"].__setitem__(1, {"pickle": "gASV"})), ["unknown argument kind 'pickle'"]),
    (_with(lambda b: _node(b, "clamp")["args"].__setitem__(1, {"device": "cuda:0"})), ["device argument"]),
    (_with(lambda b: _node(b, "exp").update(op="call_function", target="getattr",
                                            args=[{"ref": "sub"}, "__class__"])), ["getattr of '__class__'"]),
    # size
    (_with(lambda b: b["graph"].update(nodes=_nodes(b)[:3] + [
        {"op": "call_function", "name": f"n{i}", "target": "torch.exp", "args": [{"ref": "logprobs"}], "kwargs": {}}
        for i in range(custom_loss.MAX_NODES)] + _nodes(b)[-1:])), [f"at most {custom_loss.MAX_NODES}"]),
    (_with(lambda b: b["graph"].update(format=2)), ["format 2"]),
]


@pytest.mark.parametrize("make, words", BAD_GRAPHS)
def test_a_bad_graph_is_a_400_naming_the_problem(gateway, make, words):
    api = gateway.api
    session = api.session()
    assert_user_error(api.post("create_custom_loss", make(session)), 400, "create_custom_loss", *words)


def test_unknown_session_and_per_session_cap(gateway, monkeypatch):
    api = gateway.api
    assert_user_error(api.post("create_custom_loss", upload("sess-none")), 404, "unknown session_id")
    monkeypatch.setattr(custom_loss, "MAX_LOSSES_PER_SESSION", 1)
    session = api.session()
    api.result(api.post("create_custom_loss", upload(session)).json())
    assert_user_error(api.post("create_custom_loss", upload(session, seq=1)), 400, "the most one session may (1)")


def test_a_closed_sessions_losses_are_deleted(gateway):
    import time

    from gateway.storage.db import CustomLossRow
    api = gateway.api
    session = api.session()
    api.model(session)
    loss_id = api.result(api.post("create_custom_loss", upload(session)).json()).json()["loss_id"]
    db = api.client.app.state.gateway.db
    assert db.get(CustomLossRow, loss_id) is not None
    assert api.post(f"sessions/{session}/finish", {}).status_code == 200
    deadline = time.monotonic() + 10
    while db.select(select(CustomLossRow.loss_id).where(CustomLossRow.session_id == session)):
        assert time.monotonic() < deadline, "the closed session's losses are still stored"
        time.sleep(0.05)
    assert_user_error(api.post("create_custom_loss", upload(session, seq=1)), 400, "closed")
