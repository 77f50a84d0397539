"""Refused fields over HTTP, in process on fake backends (the SDK's own calls:
tests/e2e/test_wire_refusals.py): each is a 400 (category user) naming the field, and nothing
reaches the trainer; the fields the SDK always sends, at their defaults, pass. A model's request
refused for its body keeps its place in the model's order (recorded as refused, as the routes'
own refusals are), so the model's next request does not wait out the gap."""

from __future__ import annotations

import time

from gateway_fakes import gateway  # noqa: F401 - the fixture

from gateway.futures import order


def _assert_refused(response, field: str) -> None:
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["category"] == "user" and f"{field} is not served by this server" in body["error"], body


def test_each_refused_field_is_a_400_naming_it(gateway):
    api = gateway.api
    session = api.session()
    model = api.model(session)
    state = api.result(api.post("save_weights", {"model_id": model, "seq_id": 1, "path": "s"}).json()).json()["path"]
    asks = [
        ("load_weights", {"session_id": session, "model_seq_id": 5, "path": state, "optimizer": False,
                          "base_model": "other"}, "base_model"),
        ("asample", {"sampling_session_id": f"{session}:sample:0", "seq_id": 1, "prompt": {"chunks": []},
                     "sampling_params": {}, "prompt_alt_tokens_k": 2}, "prompt_alt_tokens_k"),
    ]
    requests_before = len(gateway.trainer.requests)
    runs_before = api.get("training_runs", params={"limit": 1000}).json()["training_runs"]
    for route, body, field in asks:
        _assert_refused(api.post(route, body), field)
    assert api.get("training_runs", params={"limit": 1000}).json()["training_runs"] == runs_before
    # Nothing reached the trainer: nothing made.
    assert [name for name, _ in gateway.trainer.requests[requests_before:]] == []

    # What the SDK always sends, at its defaults, is no request for anything.
    made = api.post("save_weights_external", {"model_id": model, "seq_id": 3, "path": "e",
                                              "type": "save_weights_external"})
    assert api.result(made.json()).status_code == 200


def test_a_request_refused_for_its_body_does_not_hold_up_the_models_next(gateway, monkeypatch):
    monkeypatch.setattr(order, "GAP_TIMEOUT_S", 60.0)     # a gap left open would hold the step below a minute
    api = gateway.api
    model = api.model(api.session())
    bad = api.post("save_weights_external", {"model_id": model, "seq_id": 1, "path": "e",
                                             "age_encryption_recipients": ["age1x"]})
    assert bad.status_code == 400 and "age_encryption_recipients[0]" in bad.json()["error"]
    bad = api.post("optim_step", {"model_id": model, "seq_id": 2, "adam_params": {"learning_rate": -1}})
    assert bad.status_code == 400 and "learning_rate" in bad.json()["error"]
    started = time.monotonic()
    step = api.post("optim_step", {"model_id": model, "seq_id": 3, "adam_params": {"learning_rate": 1e-3}})
    assert api.result(step.json()).status_code == 200
    assert time.monotonic() - started < 10
    assert [r.seq_id for r in gateway.trainer.of("SkipSeq")] == [1, 2]


def test_a_gap_waited_out_here_is_told_to_the_trainer(gateway, monkeypatch):
    """seq_ids that never come, on no gateway, are waited out once: the gateway tells the trainer
    (SkipSeq through_seq_id) as it sends the request after them, so the trainer does not wait out
    the same gap again (it did: 10 s here, then 10 s there)."""
    monkeypatch.setattr(order, "GAP_TIMEOUT_S", 0.3)
    api = gateway.api
    model = api.model(api.session())
    assert api.result(api.post("optim_step", {"model_id": model, "seq_id": 1,
                                              "adam_params": {"learning_rate": 1e-3}}).json()).status_code == 200
    step = api.post("optim_step", {"model_id": model, "seq_id": 5, "adam_params": {"learning_rate": 1e-3}})
    assert api.result(step.json()).status_code == 200
    told = [(r.model_id, r.seq_id, r.through_seq_id) for r in gateway.trainer.of("SkipSeq")]
    assert told == [(model, 2, 5)]
