"""Secrets at rest: the state dir is private and refused otherwise, the database holds nothing that
signs a token, signing keys rotate without ending the tokens already out, a token never buys
itself a longer life, and no credential makes the gateway answer 500."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import sqlite3
import stat
import time

import pytest
from conftest import run_tinkerd
import sqlalchemy
from fastapi.testclient import TestClient
from gateway_fakes import gateway  # noqa: F401 - the fixture

from gateway.app import create_app
from gateway.identity import signing_keys
from gateway.settings import GatewaySettings
from gateway.state import Gateway
from gateway.storage import schema
from gateway.storage.db import Base, UserRow
from gateway.storage.state_dir import StateDirError
from launcher import keys as keys_cli



def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _claims(jwt: str) -> dict:
    part = jwt.split(".")[1]
    return json.loads(base64.urlsafe_b64decode(part + "=" * (-len(part) % 4)))


def _forged(secret: bytes, claims: dict, header: dict | None = None) -> str:
    """A JWT the way the gateway signed them before the keys file: HS256 over the raw secret."""
    signed = f"{_b64(json.dumps(header or {'alg': 'HS256', 'typ': 'JWT'}).encode())}.{_b64(json.dumps(claims).encode())}"
    return f"{signed}.{_b64(hmac.new(secret, signed.encode(), hashlib.sha256).digest())}"


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _settings(state, **kw) -> GatewaySettings:
    return GatewaySettings(base_model="m", trainer="127.0.0.1:1", samplers=[], state_dir=str(state), **kw)


def test_a_new_state_dir_is_private_and_its_files_owner_only(tmp_path):
    state = tmp_path / "a" / "state"
    gw = Gateway.create(_settings(state))
    gw.db.engine.dispose()
    assert _mode(state) == 0o700
    for name in ("tinkerd.db", "signing-keys", *(f for f in os.listdir(state) if f.startswith("tinkerd.db-"))):
        assert _mode(state / name) == 0o600, name
    # `tinkerd keys` on a new dir makes it the same way
    db = keys_cli.open_database(str(tmp_path / "keys-state"), None)
    db.engine.dispose()
    assert _mode(tmp_path / "keys-state") == 0o700 and _mode(tmp_path / "keys-state" / "tinkerd.db") == 0o600


def test_an_existing_database_is_narrowed_to_0600(tmp_path):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    sqlite3.connect(state / "tinkerd.db").close()
    os.chmod(state / "tinkerd.db", 0o644)
    Gateway.create(_settings(state)).db.engine.dispose()
    assert _mode(state / "tinkerd.db") == 0o600


@pytest.mark.parametrize("mode", [0o755, 0o750, 0o701, 0o770])
def test_a_state_dir_others_may_use_is_refused_with_the_fix(tmp_path, mode):
    state = tmp_path / "state"
    state.mkdir()
    os.chmod(state, mode)
    with pytest.raises(StateDirError, match=f"mode {mode:04o}.*chmod 700 {state}"):
        Gateway.create(_settings(state))
    assert not (state / "tinkerd.db").exists() and not (state / "signing-keys").exists()   # nothing made
    Gateway.create(_settings(state, private_state_dir=False)).db.engine.dispose()          # the opt-out works
    os.chmod(state, 0o700)
    os.chmod(state / "signing-keys", 0o640)
    with pytest.raises(StateDirError, match=f"chmod 600 {state / 'signing-keys'}"):
        Gateway.create(_settings(state))


@pytest.mark.parametrize("command", ["up", "gateway"])
def test_tinkerd_up_and_gateway_refuse_a_0755_state_dir_before_starting_anything(tmp_path, command,
                                                                                tiny_model_dir):
    state = tmp_path / "state"
    state.mkdir()
    os.chmod(state, 0o755)
    argv = [command, "--base-model", tiny_model_dir, "--state-dir", str(state), "--port", "0", "--start-timeout", "5"]
    if command == "gateway":
        argv = [a for a in argv if a not in ("--start-timeout", "5")] + ["--trainer", "127.0.0.1:1"]
    r = run_tinkerd(*argv, timeout=300)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert f"chmod 700 {state}" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert os.listdir(state) == []


@pytest.mark.parametrize("command", ["up", "gateway", "trainer"])
def test_a_state_dir_that_cannot_be_made_is_refused_saying_so(tmp_path, command, tiny_model_dir):
    (tmp_path / "a-file").write_text("")
    state = tmp_path / "a-file" / "state"
    wiring = {"up": ["--port", "0"], "gateway": ["--trainer", "127.0.0.1:1"], "trainer": ["--listen", "127.0.0.1:0"]}
    r = run_tinkerd(command, "--base-model", tiny_model_dir, "--state-dir", str(state), *wiring[command], timeout=300)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert f"cannot make the state dir {state}: Not a directory" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr


def test_the_database_holds_nothing_that_signs_a_token(gateway):
    """Everything a read-only open of the database gives, tried as a signing key (raw and
    hex-decoded, with and without a kid), mints nothing the gateway accepts."""
    api = gateway.api
    gw = api.client.app.state.gateway
    api.post("auth/token", {})
    model = api.model(api.session())
    api.result(api.post("save_weights", {"model_id": model, "path": "s", "seq_id": 1}).json())
    jwt = api.post("auth/token", {}).json()["jwt"]
    kid = json.loads(base64.urlsafe_b64decode(jwt.split(".")[0] + "==="))["kid"]
    admin = gw.db.select(sqlalchemy.select(UserRow).where(UserRow.name == "admin"))[0].user_id
    claims = {**_claims(jwt), "sub": f"tml:organization_user:{admin}", "exp": int(time.time()) + 600}
    db_file = gateway.settings.state_dir + "/tinkerd.db"
    conn = sqlite3.connect(f"file:{db_file}?mode=ro", uri=True)
    tables = [t for (t,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
    assert "server_secrets" not in tables
    values = {v for t in tables for row in conn.execute(f'SELECT * FROM "{t}"') for v in row
              if isinstance(v, (str, bytes)) and len(v) >= 16}
    conn.close()
    assert values, "the database should hold some rows"
    for value in values:
        raw = value.encode() if isinstance(value, str) else value
        candidates = [raw]
        try:
            candidates.append(bytes.fromhex(raw.decode()))
        except ValueError:
            pass
        for secret in candidates:
            for header in (None, {"alg": "HS256", "typ": "JWT", "kid": kid}):
                r = api.client.post("/api/v1/create_session", json={},
                                    headers={"X-API-Key": _forged(secret, claims, header)})
                assert r.status_code == 401, value


def test_a_secret_left_in_an_old_database_is_dropped_and_signs_nothing(tmp_path):
    """A database of before the keys file (revision 0005, the secret in server_secrets): the
    upgrade drops the secret rather than moving it, so a token it signs is refused."""
    from alembic import command

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    url = f"sqlite:///{state / 'tinkerd.db'}"
    engine = sqlalchemy.create_engine(url)
    with engine.begin() as conn:
        command.upgrade(schema._config(conn), "0005_stability_records")
        secret = os.urandom(32)
        conn.execute(sqlalchemy.text("INSERT INTO server_secrets VALUES ('signing', :v)"), {"v": secret.hex()})
    engine.dispose()
    settings = _settings(state)
    with TestClient(create_app(settings)) as client:
        gw = client.app.state.gateway
        assert "server_secrets" not in sqlalchemy.inspect(gw.db.engine).get_table_names()
        assert not schema.differences(gw.db.engine, Base.metadata)
        from gateway.identity import keys
        key, row = keys.create_key(gw.db, keys.create_user(gw.db, "admin", admin=True))
        claims = {"iss": "tinkerd", "sub": "x", "kid": row.key_id, "iat": int(time.time()),
                  "exp": int(time.time()) + 600}
        r = client.post("/api/v1/create_session", json={}, headers={"X-API-Key": _forged(secret, claims)})
        assert r.status_code == 401 and 'error="invalid_token"' in r.headers["www-authenticate"]
        assert client.post("/api/v1/create_session", json={}, headers={"X-API-Key": key}).status_code == 200


def test_a_rotated_key_signs_and_the_previous_one_still_verifies(gateway, monkeypatch):
    monkeypatch.setattr(signing_keys, "RELOAD_S", 0.0)
    api = gateway.api
    keys_file = gateway.settings.signing_keys_path
    model = api.model(api.session())
    path = api.result(api.post("save_weights_external", {"model_id": model, "path": "e", "seq_id": 1}).json()
                      ).json()["path"]
    ckpt = path.split("/", 3)[3]
    old_jwt = api.post("auth/token", {}).json()["jwt"]
    old_url = api.get(f"training_runs/{model}/checkpoints/{ckpt}/external_weights_urls").json()["urls"][
        "adapter_model.safetensors"].split("://", 1)[1].split("/", 1)[1]

    def works(jwt: str) -> bool:
        return api.client.post("/api/v1/create_session", json={}, headers={"X-API-Key": jwt}).status_code == 200

    def downloads(url: str) -> bool:
        return api.client.get("/" + url, headers={"X-API-Key": ""}).status_code == 200

    kid = keys_cli.rotate_signing_key(gateway.settings.state_dir, "", keep=2)
    assert _mode(keys_file) == 0o600
    new_jwt = api.post("auth/token", {}).json()["jwt"]
    assert json.loads(base64.urlsafe_b64decode(new_jwt.split(".")[0] + "==="))["kid"] == kid
    assert works(new_jwt) and works(old_jwt) and downloads(old_url)      # no downtime
    keys_cli.rotate_signing_key(gateway.settings.state_dir, "", keep=1)     # the first key is dropped
    assert not works(old_jwt) and not downloads(old_url) and not works(new_jwt)
    assert works(api.post("auth/token", {}).json()["jwt"])


def test_a_keys_file_given_by_flag_is_used_and_checked(tmp_path):
    """A mounted Secret (--signing-keys-file): used as is, nothing made in the state dir; a bad
    one is refused with what to fix."""
    secret_file = tmp_path / "secret-keys"
    secret_file.write_text("k1 " + _b64(os.urandom(32)) + "\n")
    state = tmp_path / "state"
    gw = Gateway.create(_settings(state, signing_keys_file=str(secret_file)))
    assert not (state / "signing-keys").exists() and gw.signer.keys.current.kid == "k1"
    for bad, words in (("k1 c2hvcnQ\n", "at least 32"), ("# nothing\n", "holds no signing key"),
                       ("k1 " + "A" * 43 + "\nk1 " + "B" * 43 + "\n", "appears twice"), ("k 1 x\n", "a key line is")):
        secret_file.write_text(bad)
        with pytest.raises(Exception, match=words):
            Gateway.create(_settings(state, signing_keys_file=str(secret_file)))


def test_a_token_exchanged_for_a_token_keeps_its_expiry(gateway):
    """An API key buys a token of the full lifetime; a token (the SDK exchanges one given as its
    api_key) buys one that ends when it does, so a leaked token cannot renew itself."""
    api = gateway.api
    gw = api.client.app.state.gateway
    jwt = api.post("auth/token", {}).json()["jwt"]
    assert _claims(jwt)["exp"] - _claims(jwt)["iat"] == 3600
    caller = gw.authenticator.caller(api.api_key)[0]
    short = gw.signer.token(caller, expires=int(time.time()) + 100)
    again = api.client.post("/api/v1/auth/token", json={}, headers={"X-API-Key": short})
    assert again.status_code == 200
    assert _claims(again.json()["jwt"])["exp"] == _claims(short)["exp"]
    assert _claims(again.json()["jwt"])["kid"] == caller.key_id


@pytest.mark.parametrize("credential", ["a.b.é".encode(), "tml-é".encode(), b"\xff\xfe", "é.é.é".encode("latin-1"),
                                        b"eyJhbGciOiJIUzI1NiJ9.eyJpc3MiOiJ0aW5rZXJkIn0.\xc3\xa9"])
def test_a_non_ascii_credential_is_a_401_not_a_500(gateway, credential):
    client = gateway.api.client
    default = client.headers.pop("X-API-Key")
    try:
        for header in ({"X-API-Key": credential}, {"Authorization": b"Bearer " + credential}):
            r = client.post("/api/v1/create_session", json={}, headers=header)
            assert r.status_code == 401 and "missing" not in r.json()["error"], (header, r.text)
    finally:
        client.headers["X-API-Key"] = default


def test_a_token_with_a_non_ascii_signature_is_a_401(gateway):
    api = gateway.api
    jwt = api.post("auth/token", {}).json()["jwt"]
    head, body, _ = jwt.split(".")
    for bad in (f"{head}.{body}.é", f"{head}.{body}é.x", f"é{head}.{body}.x"):
        r = api.client.post("/api/v1/create_session", json={}, headers={"X-API-Key": bad.encode()})
        assert r.status_code == 401, bad


def test_tinkerd_keys_on_a_state_dir_without_a_database_says_it_made_a_new_one(tmp_path, capsys):
    """A mistyped --state-dir gives a key no running stack knows: said at once, not found at the 401."""
    from launcher import cli

    argv = ["keys", "create", "--user", "bob", "--state-dir", str(tmp_path / "typo")]
    keys_cli.run(cli.build_parser().parse_args(argv))
    first = capsys.readouterr()
    assert first.out.startswith("tml-")
    assert f"there was no database at {tmp_path / 'typo' / 'tinkerd.db'}; a new one is made" in first.err
    keys_cli.run(cli.build_parser().parse_args(argv[:1] + ["list"] + argv[4:]))
    again = capsys.readouterr()
    assert "bob" in again.out and again.err == ""


def test_a_token_is_checked_once_and_its_expiry_and_key_always(tmp_path, monkeypatch):
    """The signature of a token the SDK sends with every request is checked once; its expiry and
    its signing key's presence in the ring are checked every time."""
    from gateway.identity.caller import Caller
    from gateway.identity.tokens import Signer

    monkeypatch.setattr(signing_keys, "RELOAD_S", 0.0)
    path = str(tmp_path / "keys")
    signing_keys.create_if_missing(path)
    signer = Signer(signing_keys.KeyRing(path), token_ttl_s=60)
    token = signer.token(Caller(user_id="u", name="u", org_id="o", email="", admin=False, key_id="k1"))
    checks = []
    check = signer._check
    monkeypatch.setattr(signer, "_check", lambda t: checks.append(t) or check(t))
    assert [signer.token_key_id(token) for _ in range(3)] == ["k1"] * 3 and len(checks) == 1
    assert signer.token_key_id(token[:-2] + "xx") is None                # another signature: checked, refused
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now + 61)
    assert signer.token_key_id(token) is None                            # expired, though checked before
    monkeypatch.setattr(time, "time", lambda: now)
    assert signer.token_key_id(token) == "k1"
    signing_keys.rotate(path, keep=1)                                    # its key leaves the ring
    assert signer.token_key_id(token) is None
