"""create_custom_loss under load, on fake backends: what a user stores is counted in the
transaction that stores it, so a burst over two gateways gets exactly the per-user byte quota
(and the per-session count) through; the route's body is capped before it is inflated; a stored
loss is parsed once per gateway, not once per forward_backward."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time

import pytest
import zstandard
from fastapi.testclient import TestClient
from gateway_fakes import Api, FakeSampler, FakeTrainer, assert_user_error, fake_services
from gateway_fakes import gateway  # noqa: F401 - the fixture
from sqlalchemy import func, select
from test_custom_loss_routes import _fwdbwd, _post_fb, upload

from gateway import body_limit, custom_losses
from gateway.app import create_app
from gateway.storage.db import CustomLossRow
from tinkerd import custom_loss


@pytest.fixture
def two_gateways(tmp_path, db_url):
    with fake_services(tmp_path, FakeTrainer(str(tmp_path / "state")), FakeSampler(), db_url=db_url) as settings:
        with TestClient(create_app(settings)) as a, TestClient(create_app(settings)) as b:
            api_a = Api(a, "").as_user("burst")
            yield api_a, Api(b, api_a.api_key)


def _burst(apis: tuple[Api, Api], session_id: str, n: int) -> list:
    # Traced here, one at a time: torch.fx patches nn.Module.__call__ process-wide while it traces,
    # and two traces at once can leave it patched for every later test of this process.
    bodies = [upload(session_id, seq=i) for i in range(n)]
    start = threading.Barrier(n)

    def create(i: int):
        start.wait()
        return apis[i % 2].post("create_custom_loss", bodies[i])
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(create, range(n)))


def test_a_burst_of_creates_over_two_gateways_stores_exactly_the_byte_quota(two_gateways, monkeypatch):
    """Before, a session's count was checked before the insert and bytes not at all: a burst of
    256 sessions x 256 losses x 256 KiB could store ~16 GiB for one user."""
    api_a, api_b = two_gateways
    size = len(custom_loss.parse(**{k: upload("s")[k] for k in ("name", "inputs", "graph")}).canonical)
    monkeypatch.setattr(custom_losses, "MAX_BYTES_PER_USER", 4 * size + size // 2)
    sessions = [api_a.session(), api_b.session()]
    replies = _burst((api_a, api_b), sessions[0], 6) + _burst((api_b, api_a), sessions[1], 6)
    accepted = [r for r in replies if r.status_code == 200]
    assert len(accepted) == 4, [r.text for r in replies]
    for r in replies:
        if r.status_code != 200:
            assert_user_error(r, 400, f"over the {4 * size + size // 2} bytes one user may store",
                              "close the ServiceClients")
    for r in accepted:
        assert api_a.result(r.json()).json()["type"] == "create_custom_loss"
    db = api_a.client.app.state.gateway.db
    stored = db.select(select(func.sum(func.length(CustomLossRow.spec_json))))[0]
    assert stored == 4 * size
    custom_losses._SIZES._items.clear()       # as a gateway that never counted them: read from the rows
    assert_user_error(api_b.post("create_custom_loss", upload(api_b.session())), 400,
                      f"would hold {5 * size} bytes")
    # A resend of an accepted create is the same request, not a new loss: it still answers.
    first = next(i for i, r in enumerate(replies) if r.status_code == 200)
    again = (api_a, api_b)[first % 2].post("create_custom_loss", upload(sessions[first // 6], seq=first % 6))
    assert again.json()["request_id"] == accepted[0].json()["request_id"]


def test_a_burst_in_one_session_stores_exactly_its_loss_count(two_gateways, monkeypatch):
    api_a, api_b = two_gateways
    monkeypatch.setattr(custom_loss, "MAX_LOSSES_PER_SESSION", 3)
    replies = _burst((api_a, api_b), api_a.session(), 8)
    assert sum(r.status_code == 200 for r in replies) == 3, [r.text for r in replies]
    for r in replies:
        if r.status_code != 200:
            assert_user_error(r, 400, "the most one session may (3)")


def _bomb(session_id: str) -> bytes:
    """A valid-looking create_custom_loss body of ~29 MiB of JSON that zstd packs into a few KiB."""
    body = upload(session_id)
    const = [[0] * 1024 for _ in range(28)]
    nodes = body["graph"]["nodes"]
    body["graph"]["nodes"] = nodes[:3] + [
        {"op": "call_function", "name": f"n{i}", "target": "torch.tensor", "args": [const], "kwargs": {}}
        for i in range(500)] + nodes[3:]
    return zstandard.ZstdCompressor(level=19).compress(json.dumps(body).encode())


def test_the_route_body_is_capped_before_it_is_inflated(gateway):
    api = gateway.api
    bomb = _bomb(api.session())
    assert len(bomb) < 8 << 10
    started = time.monotonic()
    r = api.client.post("/api/v1/create_custom_loss", content=bomb,
                        headers={"content-type": "application/json", "content-encoding": "zstd"})
    assert_user_error(r, 413, f"more than {custom_loss.MAX_REQUEST_BYTES} bytes")
    assert time.monotonic() - started < 1.0
    plain = json.dumps(upload(api.session())).encode()
    r = api.client.post("/api/v1/create_custom_loss", content=plain + b" " * custom_loss.MAX_REQUEST_BYTES,
                        headers={"content-type": "application/json"})
    assert_user_error(r, 413, f"at most {custom_loss.MAX_REQUEST_BYTES}")
    # An ordinary upload, compressed as a client may, still goes through; a route with small bodies by
    # nature takes at most body_limit.SMALL_BYTES.
    r = api.client.post("/api/v1/create_custom_loss", content=zstandard.ZstdCompressor().compress(plain),
                        headers={"content-type": "application/json", "content-encoding": "zstd"})
    assert r.status_code == 200, r.text
    big = api.client.post("/api/v1/create_session", content=json.dumps({"tags": [], "pad": "x" * (1 << 20)}),
                          headers={"content-type": "application/json"})
    assert_user_error(big, 413, f"at most {body_limit.SMALL_BYTES}")


def test_a_stored_loss_is_parsed_once_per_gateway(gateway):
    api = gateway.api
    session = api.session()
    model_id = api.model(session)
    loss_id = api.result(api.post("create_custom_loss", upload(session)).json()).json()["loss_id"]
    parses = custom_losses._SPECS.parses
    for seq in range(1, 4):        # checked by the create: no parse at all
        r = _post_fb(api, _fwdbwd(model_id, seq, loss_id))
        assert r.status_code == 200, r.text
    assert custom_losses._SPECS.parses == parses
    custom_losses._SPECS._items.clear()        # as a gateway that did not create it: one parse, then none
    for seq in range(4, 7):
        assert _post_fb(api, _fwdbwd(model_id, seq, loss_id)).status_code == 200
    assert custom_losses._SPECS.parses == parses + 1
    assert_user_error(_post_fb(api, _fwdbwd(model_id, 7, loss_id, inputs=("old_logprobs",))), 400,
                      "no 'advantages'")
