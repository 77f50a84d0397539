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


def test_the_gap_told_to_the_trainer_stops_at_a_seq_id_another_gateway_holds(tmp_path):
    """Only the gap's first seq_id was looked for on the other gateways: the range told to the
    trainer ends at the first seq_id of the gap another gateway holds pending (the trainer must
    run that one, in its turn), not at the request after the gap."""
    from gateway.futures.store import FutureStore
    from gateway.storage.db import Database, FutureRow, Status

    db = Database(f"sqlite:///{tmp_path}/t.db")
    for seq, status in ((3, Status.PENDING), (7, Status.PENDING), (5, Status.COMPLETE), (12, Status.PENDING)):
        db.add(FutureRow(request_id=f"r{seq}", idempotency_key=f"m#{seq}", model_id="m", request_type="optim_step",
                         status=status))
    db.add(FutureRow(request_id="other", idempotency_key="m2#4", model_id="m2", request_type="optim_step"))
    store = FutureStore(db)
    assert store.first_pending_seq("m", 2, 10) == 3
    assert store.first_pending_seq("m", 3, 10) == 7
    assert store.first_pending_seq("m", 4, 7) is None        # 5 is done; 7 is the request after the gap
    assert store.first_pending_seq("m2", 1, 9) == 4
