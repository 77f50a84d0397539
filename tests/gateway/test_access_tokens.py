"""Weights access tokens on fake backends (the SDK's weights_access_token against a real stack:
tests/e2e/test_management.py): an owner's token lets one other user load and copy one checkpoint,
and nothing else; expired, revoked, foreign and malformed tokens are refused with what is wrong."""

from __future__ import annotations

import datetime

from gateway_fakes import assert_user_error, gateway  # noqa: F401 - the fixture
from sqlalchemy import select

from gateway.storage.db import AuditRow, WeightsAccessTokenRow, now


def _state(api, name: str = "s") -> tuple[str, str]:
    model = api.model(api.session())
    path = api.result(api.post("save_weights", {"model_id": model, "seq_id": 1, "path": name}).json()).json()["path"]
    return model, path


def _load(api, path: str, token: str | None):
    body = {"session_id": api.session(), "model_seq_id": 0, "path": path, "optimizer": False}
    if token is not None:
        body["weights_access_token"] = token
    return api.post("load_weights", body)


def test_a_token_grants_one_checkpoint_to_another_user(gateway):
    owner, other = gateway.api, gateway.api.as_user("bob")
    _, path = _state(owner)
    _, second = _state(owner, "second")
    assert_user_error(_load(other, path, None), 404)                 # unpublished: not bob's to read
    minted = owner.post("weights_access_tokens", {"tinker_path": path, "ttl_seconds": 3600}).json()
    token = minted["token"]
    assert token.startswith("wat-") and minted["tinker_path"] == path

    loaded = _load(other, path, token)
    assert loaded.status_code == 200, loaded.text
    assert other.result(loaded.json()).status_code == 200
    copy = other.post("copy_weights", {"source_path": path, "destination_project_id": "bobs"},
                      headers={"X-Tinker-Weights-Access-Token": token})
    assert copy.status_code == 200, copy.text
    assert copy.json()["tinker_path"].endswith("/weights/s")

    # Nothing else of the owner's: another checkpoint, nor the owner's run.
    assert_user_error(_load(other, second, token), 403, "grants", path)
    assert_user_error(other.get(f"training_runs/{path.split('/')[2]}"), 404)
    assert other.post("weights_access_tokens", {"tinker_path": path}).status_code == 404   # only the owner mints
    db = owner.client.app.state.gateway.db
    events = [r.event for r in db.select(select(AuditRow))]
    assert "checkpoint_access_token_created" in events and events.count("checkpoint_read_by_other_user") >= 2


def test_expired_revoked_and_malformed_tokens_are_refused(gateway):
    owner, other = gateway.api, gateway.api.as_user("bob")
    _, path = _state(owner)
    token = owner.post("weights_access_tokens", {"tinker_path": path}).json()
    assert_user_error(_load(other, path, "wat-nope"), 403, "not a valid weights access token")
    assert_user_error(_load(other, path, token["token"][:-2] + "xx"), 403, "not a valid")

    db = owner.client.app.state.gateway.db
    db.touch(WeightsAccessTokenRow, token["token_id"], expires_at=now() - datetime.timedelta(seconds=1))
    assert_user_error(_load(other, path, token["token"]), 403, token["token_id"], "expired")

    fresh = owner.post("weights_access_tokens", {"tinker_path": path}).json()
    listed = owner.get("weights_access_tokens", params={"tinker_path": path}).json()["tokens"]
    assert [t["token_id"] for t in listed] == [token["token_id"], fresh["token_id"]]
    assert "token" not in listed[0]                                    # shown once, at minting
    assert owner.request("DELETE", f"weights_access_tokens/{fresh['token_id']}").json()["revoked_at"]
    assert_user_error(_load(other, path, fresh["token"]), 403, "revoked")
    copy = other.post("copy_weights", {"source_path": path, "destination_project_id": "bobs"},
                      headers={"X-Tinker-Weights-Access-Token": fresh["token"]})
    assert_user_error(copy, 403, "revoked")
    assert_user_error(other.request("DELETE", f"weights_access_tokens/{token['token_id']}"), 404)
    assert_user_error(owner.post("weights_access_tokens", {"tinker_path": path, "ttl_seconds": 10}), 400, "ttl_seconds")


def test_a_token_does_not_grant_a_checkpoint_saved_again_at_its_path(gateway):
    owner, other = gateway.api, gateway.api.as_user("bob")
    model, path = _state(owner)
    token = owner.post("weights_access_tokens", {"tinker_path": path}).json()["token"]
    again = owner.post("save_weights", {"model_id": model, "seq_id": 2, "path": "s", "overwrite": True}).json()
    assert owner.result(again).status_code == 200
    assert_user_error(_load(other, path, token), 403, "since replaced")


# An SSH ed25519 public key (age encrypts to these too) and an age X25519 recipient.
SSH_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl"
AGE_KEY = "age1ql3z7hjy54pw3hyww5ayyfg7zqgvc7w3j2elw8zmrj2kg5sfn9aqmcac8p"


def test_age_recipients_go_to_the_trainer_and_a_bad_one_is_a_400(gateway):
    api = gateway.api
    model = api.model(api.session())
    ok = api.post("save_weights_external", {"model_id": model, "seq_id": 1, "path": "sealed",
                                            "age_encryption_recipients": [AGE_KEY, SSH_KEY]})
    assert api.result(ok.json()).status_code == 200
    assert list(gateway.trainer.of("SaveState")[-1].age_recipients) == [AGE_KEY, SSH_KEY]
    saves = len(gateway.trainer.of("SaveState"))
    assert_user_error(api.post("save_weights_external", {"model_id": model, "seq_id": 2, "path": "x",
                                                         "age_encryption_recipients": [AGE_KEY, "age1nope"]}),
                      400, "age_encryption_recipients[1]", "age1nope")
    assert_user_error(api.post("save_weights", {"model_id": model, "seq_id": 3, "path": "y",
                                                "age_encryption_recipients": [AGE_KEY]}),
                      400, "only save_weights_external")
    assert len(gateway.trainer.of("SaveState")) == saves
