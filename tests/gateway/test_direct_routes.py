"""The hot routes the edge calls directly (gateway/edge.py: forward_backward, optim_step,
asample, retrieve_future(s)) answer every request, good or bad, exactly as the same app answers it
through FastAPI's router: the same status, body and content type. Each request is made twice on
one gateway (fake backends over real gRPC), with the direct calls on and off."""

from __future__ import annotations

import json

import zstandard
from fastapi import Depends, FastAPI, Request

from gateway import tinker_wire_pb2 as tw
from gateway.edge import Edge
from gateway_fakes import gateway  # noqa: F401 - the fixture
from test_training_routes import _fwdbwd_body

DIRECT = {("POST", f"/api/v1/{name}") for name in ("forward_backward", "optim_step", "asample", "retrieve_future",
                                                     "retrieve_futures")}


def _fb(model_id: str, seq_id: int, loss_fn: str = "cross_entropy") -> bytes:
    req = tw.ForwardBackwardRequest.FromString(_fwdbwd_body(model_id, seq_id, [1, 2, 3]))
    req.loss_fn = loss_fn
    return req.SerializeToString()


def _requests(api) -> list[tuple[str, bytes, dict]]:
    """(path, body, headers): each direct route's good requests and its bad ones."""
    model_id = api.model(api.session())
    sid = api.post("create_sampling_session", {"session_id": api.session(), "base_model": "tiny/base"}).json()
    sid = sid["sampling_session_id"]
    sample = {"sampling_session_id": sid, "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
              "sampling_params": {"max_tokens": 2}}
    proto, js = {"content-type": "application/x-protobuf"}, {"content-type": "application/json"}
    return [
        ("forward_backward", _fb(model_id, 1), proto),
        ("forward_backward", zstandard.compress(_fb(model_id, 2)), {**proto, "content-encoding": "zstd"}),
        ("forward_backward", _fb(model_id, 1), proto),                          # a resend
        ("forward_backward", _fb("nobody:train:0", 1), proto),                  # unknown model: 404
        ("forward_backward", _fb(model_id, 3, loss_fn="no_such_loss"), proto),
        ("forward_backward", b"\xff\x00 not protobuf", proto),
        ("forward_backward", b'{"model_id": "m"}', js),                         # JSON: refused
        ("forward_backward", zstandard.compress(b"x" * 10) + b"junk", {**proto, "content-encoding": "zstd"}),
        ("optim_step", json.dumps({"model_id": model_id, "seq_id": 4, "adam_params": {"learning_rate": 1e-4}}
                                  ).encode(), js),
        ("optim_step", json.dumps({"model_id": model_id, "seq_id": 5, "adam_params": {"beta1": 1.0}}).encode(), js),
        ("optim_step", json.dumps({"model_id": model_id, "seq_id": 6, "adam_params": {"learning_rate": "x"}}
                                  ).encode(), js),
        ("optim_step", b'{"model_id": 5}', js),
        ("optim_step", b"[]", js),
        ("optim_step", b"{bad", js),
        ("optim_step", json.dumps({"model_id": model_id, "seq_id": 7, "adam_params": {}}).encode(), js),
        ("asample", json.dumps({**sample, "seq_id": 0}).encode(), js),
        ("asample", json.dumps({**sample, "seq_id": 0}).encode(), js),          # a resend
        ("asample", json.dumps({**sample, "seq_id": 1, "num_samples": 0}).encode(), js),
        ("asample", json.dumps({**sample, "seq_id": 2, "sampling_session_id": "nope"}).encode(), js),
        ("asample", b"{not json", js),
        ("asample", b"", js),
        ("asample", b"[1, 2]", js),
        ("retrieve_future", b'{"request_id": "no-such-future"}', js),
        ("retrieve_future", b'{"request_id": 7}', js),
        ("retrieve_future", b"{", js),
        ("retrieve_future", b"{}", js),
        ("retrieve_futures", json.dumps({"target": {"sampling_session_id": sid, "cloned_sampler_id": 0},
                                         "prev_cursor": None, "timeout": 0}).encode(), js),
        ("retrieve_futures", json.dumps({"target": {"sampling_session_id": "nope", "cloned_sampler_id": 0},
                                         "timeout": 0}).encode(), js),
        ("retrieve_futures", b'{"target": 1}', js),
    ]


_VARYING = ("request_id", "sample_sequence_ids", "model_id", "completions", "cursor")


def _answer(api, path: str, body: bytes, headers: dict):
    r = api.client.post(f"/api/v1/{path}", content=body, headers={"X-API-Key": api.api_key, **headers})
    payload = r.json()
    if isinstance(payload, dict):      # ids, and what a poll finds, differ from call to call: their types count
        payload = {k: (type(v).__name__ if k in _VARYING else v) for k, v in payload.items()}
    return r.status_code, r.headers.get("content-type"), payload


def test_only_a_route_the_router_would_call_with_the_request_alone_is_direct():
    app = FastAPI()

    async def dependency():
        return 1

    @app.post("/first/{name}")
    async def catch_all(request: Request):
        return {}

    @app.post("/plain")
    async def plain(request: Request):
        return {}

    @app.post("/first/shadowed")            # the router takes /first/{name} for it
    async def shadowed(request: Request):
        return {}

    @app.post("/query")
    async def query(request: Request, n: int = 0):
        return {}

    @app.api_route("/two", methods=["GET", "POST"])
    async def two(request: Request):
        return {}

    @app.post("/depends", dependencies=[Depends(dependency)])
    async def depends(request: Request):
        return {}

    edge = Edge(app, None, None, app.router.routes, app.exception_handlers)
    assert set(edge.direct()) == {("POST", "/plain")}


def test_the_direct_routes_are_the_hot_ones(gateway):
    gateway.api.session()          # the app has served a request: its edge is built
    assert DIRECT <= set(_edge(gateway).direct())


def test_each_answer_is_the_routers_answer(gateway, monkeypatch):
    api = gateway.api
    direct = [_answer(api, *request) for request in _requests(api)]
    monkeypatch.setattr(_edge(gateway), "_direct", {})            # every request through the router
    routed = [_answer(api, *request) for request in _requests(api)]
    assert {status for status, _, _ in direct} >= {200, 400, 404}
    for (path, body, _), a, b in zip(_requests(api), direct, routed):
        assert a == b, (path, body[:80])


def _edge(gateway) -> Edge:
    stack = gateway.api.client.app.middleware_stack
    while not isinstance(stack, Edge):
        stack = stack.app
    return stack
