"""Identity at the gateway, on fake backends: API keys and tokens, what one user can see of
another's work (nothing, unless published), the audit log, signed download URLs, per-user limits.
The same holds end to end through the real SDK in tests/e2e/test_identity.py."""

from __future__ import annotations

import base64
import json
import time

import pytest
from gateway_fakes import assert_user_error, gateway  # noqa: F401 - the fixture

from gateway.identity import keys


def _claims(jwt: str) -> dict:
    payload = jwt.split(".")[1]
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))


def test_no_key_a_wrong_key_and_a_revoked_key_get_401(gateway, monkeypatch):
    api = gateway.api
    assert api.client.post("/api/v1/client/config", json={}, headers={"X-API-Key": ""}).status_code == 401
    for bad in ("tml-anything", "tml-0123456789abcdef-" + "A" * 43, api.api_key[:-1] + "x"):
        r = api.client.post("/api/v1/create_session", json={}, headers={"X-API-Key": bad})
        assert_user_error(r, 401, "unknown or revoked API key")
    assert api.client.get("/api/v1/healthz", headers={"X-API-Key": ""}).status_code != 401
    monkeypatch.setattr(keys, "AUTH_CACHE_S", 0.0)
    keys.revoke_key(api.client.app.state.gateway.db, api.api_key)
    assert_user_error(api.post("create_session", {}), 401, "revoked")


def test_the_jwt_names_the_user_and_replaces_the_key(gateway, monkeypatch):
    api = gateway.api
    assert api.post("client/config", {}).json()["pjwt_auth_enabled"] is True
    jwt = api.post("auth/token", {}).json()["jwt"]
    claims = _claims(jwt)
    assert claims["sub"].startswith("tml:organization_user:user-") and claims["org_id"] == "default"
    assert claims["email"] == "tester@example.com" and claims["exp"] - claims["iat"] == 3600
    assert api.client.post("/api/v1/create_session", json={}, headers={"X-API-Key": jwt}).status_code == 200
    forged = jwt[:-2] + ("AA" if not jwt.endswith("AA") else "BB")
    r = api.client.post("/api/v1/create_session", json={}, headers={"X-API-Key": forged})
    assert r.status_code == 401 and 'error="invalid_token"' in r.headers["www-authenticate"]
    monkeypatch.setattr(keys, "AUTH_CACHE_S", 0.0)
    keys.revoke_key(api.client.app.state.gateway.db, api.api_key)     # its tokens die with it
    assert api.client.post("/api/v1/create_session", json={}, headers={"X-API-Key": jwt}).status_code == 401


def _alice_work(api) -> dict:
    """A session, a model, a saved state, a sampler checkpoint, a sampling session and a future."""
    session = api.session()
    model = api.model(session)
    state = api.result(api.post("save_weights", {"model_id": model, "path": "s1", "seq_id": 1}).json()).json()["path"]
    future = api.post("save_weights_for_sampler", {"model_id": model, "path": "w1", "seq_id": 2}).json()
    sampler = api.result(future).json()["path"]
    sampling = api.post("create_sampling_session", {"session_id": session, "model_path": sampler}).json()
    return {"session": session, "model": model, "state": state, "sampler": sampler, "future": future["request_id"],
            "sampling": sampling["sampling_session_id"]}


def _reads(w: dict) -> list[tuple[str, str, dict | None]]:
    """Every route that names one of the ids, as (method, path, body)."""
    run, ckpt = w["model"], w["state"].split("/", 3)[3]
    return [
        ("POST", "get_info", {"model_id": run}),
        ("POST", "optim_step", {"model_id": run, "seq_id": 9}),
        ("POST", "save_weights", {"model_id": run, "path": "mine", "seq_id": 9}),
        ("POST", "save_weights_for_sampler", {"model_id": run, "seq_id": 9}),
        ("POST", "load_weights", {"path": w["state"], "model_id": run, "seq_id": 9}),
        ("POST", "create_model", {"session_id": w["session"], "base_model": "tiny/base"}),
        ("POST", "session_heartbeat", {"session_id": w["session"]}),
        ("POST", "asample", {"sampling_session_id": w["sampling"], "prompt": {"chunks": []}, "seq_id": 1}),
        ("POST", "retrieve_future", {"request_id": w["future"]}),
        ("POST", "weights_info", {"tinker_path": w["state"]}),
        ("POST", "copy_weights", {"source_path": w["state"], "destination_project_id": "p"}),
        ("GET", f"training_runs/{run}", None),
        ("GET", f"training_runs/{run}/checkpoints", None),
        ("POST", f"training_runs/{run}/checkpoints/{ckpt}/publish", None),
        ("DELETE", f"training_runs/{run}/checkpoints/{ckpt}/publish", None),
        ("PUT", f"training_runs/{run}/checkpoints/{ckpt}/ttl", {"ttl_seconds": 5}),
        ("DELETE", f"training_runs/{run}/checkpoints/{ckpt}", None),
        ("GET", f"samplers/{w['sampling']}", None),
        ("GET", f"sessions/{w['session']}", None),
        ("POST", f"sessions/{w['session']}/finish", None),
    ]


def test_another_user_gets_404_for_every_id_and_sees_nothing_in_lists(gateway):
    alice, bob = gateway.api, gateway.api.as_user("bob")
    work = _alice_work(alice)
    for method, path, body in _reads(work):
        r = bob.request(method, path, json=body)
        assert r.status_code == 404 and r.json()["category"] == "user", (method, path, r.status_code, r.text)
    bob_session = bob.session()
    r = bob.post("create_sampling_session", {"session_id": bob_session, "model_path": work["sampler"]})
    assert_user_error(r, 404, "unknown checkpoint")
    r = bob.post("load_weights", {"path": work["state"], "session_id": bob_session, "model_seq_id": 0})
    assert_user_error(r, 404, "unknown checkpoint")
    assert bob.get("training_runs").json()["training_runs"] == []
    assert bob.get("checkpoints").json()["checkpoints"] == []
    assert bob.get("sessions").json()["sessions"] == [bob_session]
    # ...and all of alice's work is still there and hers.
    assert [c["checkpoint_id"] for c in alice.get("checkpoints").json()["checkpoints"]] == [
        "weights/s1", "sampler_weights/w1"]
    run = alice.get(f"training_runs/{work['model']}").json()
    assert run["model_owner"].startswith("tml:organization_user:user-")


def test_a_published_checkpoint_is_readable_by_all_and_changeable_by_its_owner(gateway):
    alice, bob = gateway.api, gateway.api.as_user("bob")
    work = _alice_work(alice)
    run, ckpt = work["model"], work["state"].split("/", 3)[3]
    assert alice.post(f"training_runs/{run}/checkpoints/{ckpt}/publish").status_code == 200
    alice.post(f"training_runs/{run}/checkpoints/sampler_weights/w1/publish")
    assert bob.post("weights_info", {"tinker_path": work["state"]}).json()["lora_rank"] == 8
    session = bob.session()
    loaded = bob.post("load_weights", {"path": work["state"], "session_id": session, "model_seq_id": 0}).json()
    assert bob.result(loaded).json()["model_id"] == f"{session}:train:0"
    assert bob.post("create_sampling_session", {"session_id": session, "model_path": work["sampler"]}).status_code == 200
    for method, suffix in (("DELETE", "/publish"), ("PUT", "/ttl"), ("DELETE", "")):
        r = bob.request(method, f"training_runs/{run}/checkpoints/{ckpt}{suffix}", json={"ttl_seconds": 5})
        assert r.status_code == 404, (method, suffix, r.text)
    assert [r["training_run_id"] for r in bob.get("training_runs").json()["training_runs"]] == [f"{session}:train:0"]


def test_the_audit_log_is_for_admins(gateway):
    alice = gateway.api
    _alice_work(alice)
    assert_user_error(alice.get("audit"), 403, "admins")
    admin = alice.as_user("boss", admin=True)
    entries = admin.get("audit", params={"day": time.strftime("%Y-%m-%d", time.gmtime())}).json()["entries"]
    events = [e["event"] for e in entries]
    for event in ("api_key_created", "session_created", "training_run_created", "checkpoint_saved"):
        assert event in events, events
    saved = [e for e in entries if e["event"] == "checkpoint_saved"]
    assert {e["tinker_path"] for e in saved} >= {s for s in (saved[0]["tinker_path"],)}
    assert all(e["event_details"]["user_id"].startswith("user-") for e in entries)
    assert admin.get("audit", params={"day": "2020-01-01"}).json()["entries"] == []
    assert admin.get("audit", params={"event_type": "checkpoints"}).json()["entries"][0]["event"] == "checkpoint_saved"


def test_limits_answer_429_with_retry_after_or_a_400_that_says_what_to_do(gateway):
    api = gateway.api
    session = api.session()
    model = api.model(session)
    sampling = api.post("create_sampling_session", {"session_id": session, "base_model": "tiny/base"}).json()
    gateway.settings.max_samples_per_user = 0
    r = api.post("asample", {"sampling_session_id": sampling["sampling_session_id"], "seq_id": 1,
                             "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]}})
    assert r.status_code == 429 and "in flight" in r.json()["error"] and r.headers["retry-after"]
    gateway.settings.max_queued_per_user = 0
    assert api.post("optim_step", {"model_id": model, "seq_id": 1}).status_code == 429
    gateway.settings.max_models_per_user = 1
    r = api.post("create_model", {"session_id": session, "model_seq_id": 1, "base_model": "tiny/base"})
    assert_user_error(r, 400, "close a ServiceClient")
    gateway.settings.max_checkpoint_gb_per_user = 0.0
    assert_user_error(api.post("save_weights", {"model_id": model, "path": "x", "seq_id": 1}), 400, "delete some")


@pytest.mark.parametrize("tamper", ["signature", "expires", "path"])
def test_external_weights_urls_are_signed(gateway, tamper):
    api = gateway.api
    model = api.model(api.session())
    saved = api.result(api.post("save_weights_external", {"model_id": model, "path": "e", "seq_id": 1}).json())
    run, ckpt = model, saved.json()["path"].split("/", 3)[3]
    urls = api.get(f"training_runs/{run}/checkpoints/{ckpt}/external_weights_urls").json()["urls"]
    url = urls["adapter_model.safetensors"].split("://", 1)[1].split("/", 1)[1]
    assert api.client.get("/" + url, headers={"X-API-Key": ""}).content == b"x" * 10
    bad = {"signature": url.replace("signature=", "signature=A"), "expires": url.replace("expires=", "expires=1"),
           "path": url.replace("adapter_model", "other")}[tamper]
    assert api.client.get("/" + bad, headers={"X-API-Key": ""}).status_code == 404


def test_no_auth_makes_every_caller_the_admin(tmp_path):
    """`--no-auth`, for local experiments: no key needed, no JWT flow, everything is the admin's."""
    from fastapi.testclient import TestClient

    from gateway.app import create_app
    from gateway.settings import GatewaySettings

    settings = GatewaySettings(base_model="m", trainer="127.0.0.1:1", samplers=["127.0.0.1:1"],
                               state_dir=str(tmp_path / "state"), auth=False)
    with TestClient(create_app(settings)) as client:
        assert client.post("/api/v1/client/config", json={}).json()["pjwt_auth_enabled"] is False
        session = client.post("/api/v1/create_session", json={}).json()["session_id"]
        assert client.get("/api/v1/sessions").json()["sessions"] == [session]
        assert client.get("/api/v1/audit").status_code == 200


def test_metadata_stored_with_nan_before_the_edge_refused_it_lists_as_null(gateway):
    """A database from before the edge checks may hold NaN in user_metadata: lists still answer."""
    from gateway.storage.db import CheckpointRow

    api = gateway.api
    model = api.model(api.session())
    path = api.result(api.post("save_weights", {"model_id": model, "path": "m", "seq_id": 1}).json()).json()["path"]
    gw = api.client.app.state.gateway
    gw.db.touch(CheckpointRow, path, user_metadata={"loss": float("nan"), "ok": [1.5, float("inf")]})
    (listed,) = api.get("checkpoints").json()["checkpoints"]
    assert listed["user_metadata"] == {"loss": None, "ok": [1.5, None]}
