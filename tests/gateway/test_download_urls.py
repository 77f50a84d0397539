"""Signed download URLs (external_weights files, checkpoint archives) last only as long as the
access that made them: they end when the checkpoint is deleted or saved again, when it is
unpublished (for another user's URL), and when the API key that made them is revoked; they are
signed with the URL key, not the JWT key; downloads and reads of another user's checkpoint are
in the audit log (the owner's organization's and the reader's), and so are expired checkpoints."""

from __future__ import annotations

import base64
import datetime
import hashlib
import hmac
import urllib.parse

from fastapi.testclient import TestClient
from gateway_fakes import Api, FakeSampler, FakeTrainer, fake_services, gateway  # noqa: F401 - the fixture

from gateway.app import create_app
from gateway.checkpoints import delete_expired_checkpoints, download_grant
from gateway.identity import audit, keys
from gateway.storage.db import CheckpointRow, now


def _today(gw, org: str) -> list:
    return audit.day_of(gw.db, org, datetime.datetime.now(datetime.timezone.utc).date())


def _external(api, name: str = "e", seq_id: int = 1) -> tuple[str, str]:
    """A model with an external_weights checkpoint: (run id, checkpoint id)."""
    model = api.model(api.session())
    path = api.result(api.post("save_weights_external", {"model_id": model, "path": name, "seq_id": seq_id}).json()
                      ).json()["path"]
    return model, path.split("/", 3)[3]


def _url(api, run: str, ckpt: str) -> str:
    full = api.get(f"training_runs/{run}/checkpoints/{ckpt}/external_weights_urls").json()["urls"][
        "adapter_model.safetensors"]
    return "/" + full.split("://", 1)[1].split("/", 1)[1]


def _get(api, url: str):
    return api.client.get(url, headers={"X-API-Key": ""})


def test_another_users_url_ends_when_the_checkpoint_is_unpublished(gateway):
    alice, bob = gateway.api, gateway.api.as_user("bob")
    run, ckpt = _external(alice)
    assert bob.get(f"training_runs/{run}/checkpoints/{ckpt}/external_weights_urls").status_code == 404
    alice.post(f"training_runs/{run}/checkpoints/{ckpt}/publish")
    bobs, alices = _url(bob, run, ckpt), _url(alice, run, ckpt)
    assert _get(bob, bobs).content == b"x" * 10
    alice.request("DELETE", f"training_runs/{run}/checkpoints/{ckpt}/publish")
    r = _get(bob, bobs)
    assert r.status_code == 404 and "no longer grants access" in r.json()["error"]
    assert _get(alice, alices).status_code == 200           # the owner's own URL stays good


def test_a_url_ends_when_the_checkpoint_is_deleted_and_is_not_good_for_one_saved_again_under_its_name(gateway):
    api = gateway.api
    model = api.model(api.session())
    saved = api.post("save_weights_external", {"model_id": model, "path": "e", "seq_id": 1}).json()
    ckpt = api.result(saved).json()["path"].split("/", 3)[3]
    old = _url(api, model, ckpt)
    assert _get(api, old).status_code == 200
    assert api.request("DELETE", f"training_runs/{model}/checkpoints/{ckpt}").status_code == 200
    assert _get(api, old).status_code == 404
    api.result(api.post("save_weights_external", {"model_id": model, "path": "e", "seq_id": 2}).json())
    assert _get(api, old).status_code == 404                 # same path, a new row: the old link stays dead
    assert _get(api, _url(api, model, ckpt)).status_code == 200
    # overwriting in place is a new generation too
    newer = _url(api, model, ckpt)
    api.result(api.post("save_weights_external", {"model_id": model, "path": "e", "seq_id": 3,
                                                  "overwrite": True}).json())
    assert _get(api, newer).status_code == 404


def test_a_url_ends_when_the_key_that_made_it_is_revoked(gateway, monkeypatch):
    monkeypatch.setattr(keys, "AUTH_CACHE_S", 0.0)
    alice = gateway.api
    carol = alice.as_user("carol")
    run, ckpt = _external(carol)
    url = _url(carol, run, ckpt)
    assert _get(carol, url).status_code == 200
    keys.revoke_key(alice.client.app.state.gateway.db, carol.api_key)
    assert _get(alice, url).status_code == 404


def test_an_archive_url_is_checked_the_same_way(gateway):
    alice, bob = gateway.api, gateway.api.as_user("bob")
    model = alice.model(alice.session())
    ckpt = alice.result(alice.post("save_weights", {"model_id": model, "path": "s", "seq_id": 1}).json()
                        ).json()["path"].split("/", 3)[3]
    alice.post(f"training_runs/{model}/checkpoints/{ckpt}/publish")
    r = bob.get(f"training_runs/{model}/checkpoints/{ckpt}/archive", follow_redirects=False)
    assert r.status_code == 302
    url = "/" + r.headers["location"].split("://", 1)[1].split("/", 1)[1]
    assert _get(bob, url).status_code == 200
    alice.request("DELETE", f"training_runs/{model}/checkpoints/{ckpt}/publish")
    assert _get(bob, url).status_code == 404


def test_urls_are_signed_with_their_own_key_and_tampering_or_non_ascii_is_a_404(gateway):
    api = gateway.api
    gw = api.client.app.state.gateway
    run, ckpt = _external(api)
    url = _url(api, run, ckpt)
    path, query = url.split("?", 1)
    params = dict(urllib.parse.parse_qsl(query))
    key = gw.signer.keys.current
    row = gw.db.get(CheckpointRow, f"tinker://{run}/{ckpt}")
    grant = download_grant(row, path, int(params["expires"]), row.owner, params["by"])
    assert key.url != key.jwt
    with_jwt_key = base64.urlsafe_b64encode(hmac.new(key.jwt, grant.message(), hashlib.sha256).digest()
                                            ).rstrip(b"=").decode()
    cases = {"jwt key": {**params, "signature": with_jwt_key}, "no by": {**params, "by": ""},
             "other kid": {**params, "kid": "nope"}, "later expiry": {**params, "expires": str(int(params["expires"]) + 1)},
             "non-ascii signature": {**params, "signature": "é"}, "non-ascii by": {**params, "by": "é" * 16},
             "non-ascii kid": {**params, "kid": "é"}, "non-ascii expires": {**params, "expires": "é"}}
    for what, bad in cases.items():
        r = _get(api, f"{path}?{urllib.parse.urlencode(bad)}")
        assert r.status_code == 404, (what, r.text)
    assert _get(api, f"{path}?expires={params['expires']}&signature=%C3%A9").status_code == 404
    assert _get(api, f"{path}é?{query}").status_code == 404
    assert _get(api, url).status_code == 200


def test_downloads_and_reads_of_another_users_checkpoint_are_audited_in_both_orgs(gateway):
    alice, bob = gateway.api, gateway.api.as_user("bob-other", org_id="other")
    gw = alice.client.app.state.gateway
    run, ckpt = _external(alice)
    _get(alice, _url(alice, run, ckpt))
    own = [e for e in _today(gw, "default") if e.event == "checkpoint_downloaded"]
    assert len(own) == 1 and own[0].details["file"] == "adapter_model.safetensors"
    assert not [e for e in _today(gw, "default") if e.event == "checkpoint_read_by_other_user"]
    alice.post(f"training_runs/{run}/checkpoints/{ckpt}/publish")
    assert bob.post("weights_info", {"tinker_path": f"tinker://{run}/{ckpt}"}).status_code == 200
    _get(bob, _url(bob, run, ckpt))
    bob_user = gw.authenticator.caller(bob.api_key)[0].user_id
    for org in ("default", "other"):
        events = [(e.event, e.details.get("via")) for e in _today(gw, org) if e.user_id == bob_user]
        assert ("checkpoint_read_by_other_user", "weights_info") in events, (org, events)
        assert ("checkpoint_read_by_other_user", "external_weights_urls") in events, (org, events)
        assert ("checkpoint_downloaded", None) in events, (org, events)
    # the audit log route shows them to an admin, under the checkpoints filter
    admin = alice.as_user("boss", admin=True)
    shown = {e["event"] for e in admin.get("audit", params={"event_type": "checkpoints"}).json()["entries"]}
    assert {"checkpoint_downloaded", "checkpoint_read_by_other_user"} <= shown


def test_an_expired_checkpoint_is_recorded(gateway):
    api = gateway.api
    gw = api.client.app.state.gateway
    run, ckpt = _external(api)
    gw.db.touch(CheckpointRow, f"tinker://{run}/{ckpt}", expires_at=now() - datetime.timedelta(seconds=1))
    assert delete_expired_checkpoints(gw.db) == 1
    (expired,) = [e for e in _today(gw, "default") if e.event == "checkpoint_expired"]
    assert expired.details["tinker_path"] == f"tinker://{run}/{ckpt}"
    assert expired.user_id == gw.authenticator.caller(api.api_key)[0].user_id


def test_with_auth_off_urls_work_without_a_key(tmp_path):
    """--no-auth: the URL names no key; it is checked as the one anonymous admin's."""
    trainer = FakeTrainer(str(tmp_path / "state"))
    with fake_services(tmp_path, trainer, FakeSampler(), auth=False) as settings, \
            TestClient(create_app(settings)) as client:
        api = Api(client, "")
        run, ckpt = _external(api)
        url = _url(api, run, ckpt)
        assert "by=&" in url and _get(api, url).status_code == 200
