"""The console's routes on fake backends: every forward_backward/optim_step leaves a metrics row
per step, the console's JSON routes answer about the caller's own rows only (another user's run
is a 404 like a missing one), the page and its files need no key, and a run's metrics go with
the run."""

import numpy as np
import pytest
from sqlalchemy import select

from gateway import tinker_wire_pb2 as tw
from gateway.storage.db import ModelRow, StepMetricRow
from gateway_fakes import assert_user_error, gateway  # noqa: F401 - the fixture

PROTOBUF = {"content-type": "application/x-protobuf"}


def _fwdbwd_body(model_id: str, seq_id: int, tokens: list[int], weights: list[float], forward_only=False) -> bytes:
    req = tw.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy", forward_only=forward_only)
    datum = req.data.add()
    datum.model_input.add().encoded_text.tokens = np.asarray(tokens, "<i4").tobytes()
    targets = datum.loss_fn_inputs["target_tokens"]
    targets.dtype, targets.dense = tw.DTYPE_INT64, np.asarray(tokens[1:] + [0], "<i8").tobytes()
    w = datum.loss_fn_inputs["weights"]
    w.dtype, w.dense = tw.DTYPE_FLOAT32, np.asarray(weights, "<f4").tobytes()
    return req.SerializeToString()


def _train(api, model_id: str, steps: int) -> None:
    """`steps` times: a forward_backward of 3 tokens (weights summing to 2), then an optim_step."""
    for step in range(steps):
        fb = api.client.post("/api/v1/forward_backward", headers={**PROTOBUF, "X-API-Key": api.api_key},
                             content=_fwdbwd_body(model_id, 2 * step + 1, [5, 6, 7], [0.0, 1.0, 1.0]))
        opt = api.post("optim_step", {"model_id": model_id, "seq_id": 2 * step + 2,
                                      "adam_params": {"learning_rate": 0.01 * (step + 1)}})
        assert api.result(fb.json()).status_code == 200
        assert api.result(opt.json()).status_code == 200


def test_steps_are_recorded_and_shown_to_their_owner_only(gateway):
    alice = gateway.api
    bob = alice.as_user("bob")
    run = alice.model(alice.session())
    _train(alice, run, steps=2)
    evaluation = alice.client.post("/api/v1/forward_backward", headers={**PROTOBUF, "X-API-Key": alice.api_key},
                                   content=_fwdbwd_body(run, 5, [5, 6], [1.0, 1.0], forward_only=True))
    assert alice.result(evaluation.json()).status_code == 200

    got = alice.get(f"console/training_runs/{run}/metrics")
    assert got.status_code == 200, got.json()
    steps = got.json()["steps"]
    assert [(s["seq_id"], s["step"], s["kind"]) for s in steps] == [
        (1, 1, "forward_backward"), (2, 1, "optim_step"), (3, 2, "forward_backward"), (4, 2, "optim_step"),
        (5, 3, "forward")]
    fb, opt = steps[0]["metrics"], steps[3]["metrics"]
    assert fb == {"loss:sum": 1.5, "tokens:sum": 3.0, "datums:sum": 1.0, "weights:sum": 2.0, "loss:mean": 0.75}
    assert opt["learning_rate"] == pytest.approx(0.02) and opt["step:max"] == 2.0

    # Bob sees nothing of Alice's: her run is as unknown as a missing one, his lists are his own.
    for who, run_id in ((bob, run), (alice, "sess-nope:train:0")):
        assert_user_error(who.get(f"console/training_runs/{run_id}/metrics"), 404, "unknown training run")
    bob_session = bob.session()
    assert [s["session_id"] for s in bob.get("console/sessions").json()["sessions"]] == [bob_session]
    (mine,) = alice.get("console/sessions").json()["sessions"]
    assert mine["training_run_ids"] == [run] and mine["closed"] is False
    sid = alice.post("create_sampling_session", {"session_id": mine["session_id"], "base_model": "tiny/base"}).json()
    assert [s["sampling_session_id"] for s in alice.get("console/sampling_sessions").json()["sampling_sessions"]] == [
        sid["sampling_session_id"]]
    assert bob.get("console/sampling_sessions").json() == {"sampling_sessions": []}
    queue = bob.get("console/queue").json()
    assert queue["total"] == 0 and queue["pending"]["forward_backward"] == 0

    # A run's metrics go with its row.
    db = alice.client.app.state.gateway.db
    assert db.delete(ModelRow, run)
    assert db.select(select(StepMetricRow)) == []


def test_the_page_needs_no_key_and_the_json_routes_do(gateway):
    client = gateway.api.client
    anonymous = {"X-API-Key": ""}
    page = client.get("/console", headers=anonymous)
    assert page.status_code == 200 and "tinkerd console" in page.text
    assert client.get("/console/static/console.js", headers=anonymous).status_code == 200
    assert client.get("/console/static/secrets.txt", headers=anonymous).status_code == 404
    assert client.get("/console/static/..%2fstep_metrics.py", headers=anonymous).status_code == 404
    assert client.get("/api/v1/console/queue", headers=anonymous).status_code == 401
    # The fakes' base model is no directory: the playground's tokenizer is a clear 400, not a 500.
    assert_user_error(gateway.api.post("console/tokenize", {"text": "hi"}), 400, "no tokenizer")


def test_playground_tokenizes_and_detokenizes_with_the_base_models_tokenizer(gateway):
    """The text <-> token ids of the base model's tokenizer (run in the tokenizer pool, off the
    event loop), and the bounds on what one call may ask for."""
    from harness.models import build_tokenizer

    tok = build_tokenizer()
    tok.save_pretrained(gateway.settings.base_model)
    text = "naïve café — 東京"
    ids = gateway.api.post("console/tokenize", {"text": text}).json()["tokens"]
    assert ids == tok.encode(text, add_special_tokens=False)
    assert gateway.api.post("console/detokenize", {"tokens": ids}).json() == {"text": text}
    assert_user_error(gateway.api.post("console/detokenize", {"tokens": [len(tok)]}), 400, "outside the vocabulary")
    assert_user_error(gateway.api.post("console/detokenize", {"tokens": [1] * 131_073}), 400, "131072")
    assert_user_error(gateway.api.post("console/tokenize", {"text": "x" * 100_001}), 400, "100000")


def test_the_console_is_sent_with_its_security_headers(gateway):
    """Its own script and style only (no inline code runs), never in a frame, no type sniffing."""
    client = gateway.api.client
    for path in ("/console", "/console/static/console.js", "/console/static/console.css", "/console/"):
        r = client.get(path, headers={"X-API-Key": ""}, follow_redirects=False)
        assert r.status_code in (200, 307), (path, r.status_code)
        csp = {d.split()[0]: d.split()[1:] for d in r.headers["content-security-policy"].split("; ")}
        assert csp["script-src"] == ["'self'"] and csp["default-src"] == ["'self'"], csp
        assert csp["frame-ancestors"] == ["'none'"] and csp["object-src"] == ["'none'"], csp
        assert r.headers["x-frame-options"] == "DENY" and r.headers["x-content-type-options"] == "nosniff"
    # The page loads no inline script or style that the policy would block.
    page = client.get("/console", headers={"X-API-Key": ""}).text
    assert "<script>" not in page and "<style" not in page and " style=" not in page and "onclick" not in page
