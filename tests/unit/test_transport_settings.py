"""How `tinkerd up` and the services are wired for HTTPS and the gateway's internal listener, and
the secrets kept off command lines and terminals: a replica registers at the internal listener
(https, trusting the certificate, when the gateway serves HTTPS); a replica with TLS refuses to
send the service token over plain http to another host; the admin's key goes to a 0600 file; the
database password comes from a file or the environment. (The whole path over HTTPS, with the SDK:
tests/e2e/test_https.py.)"""

from __future__ import annotations

import os
import stat

import pytest
import sqlalchemy

from gateway.settings import database_url
from launcher import cli, keys, up
from sampler_service.registration import check_urls, client_context
from tinkerd import settings


def _up_args(tmp_path, *flags: str):
    args = cli.build_parser().parse_args(["up", "--base-model", str(tmp_path), *flags])
    args.port, args.internal_port = 8443, 9443        # what `up` fixes before anything starts
    return args


def _child(args, name: str, ready: dict):
    argv = up.child_argv(args, name, **up._wiring(args, name, ready))
    return settings.from_args(up.CHILDREN[up.kind_of(name)], cli.build_parser().parse_args(argv))


def test_up_s_replicas_register_at_the_internal_listener_over_https_trusting_the_certificate(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    args = _up_args(tmp_path, "--https-cert", str(cert), "--https-key", str(key), "--sampler-replicas", "2")
    replica = _child(args, "sampler-2", {"trainer": 5000})
    assert replica.register_with == ["https://127.0.0.1:9443"] and replica.register_ca == str(cert)
    gateway = _child(args, "gateway", {"trainer": 5000})
    assert (gateway.https_cert, gateway.https_key, gateway.internal_port) == (str(cert), str(key), 9443)
    assert up.gateway_url(args) == "https://127.0.0.1:9443"
    # Without HTTPS: plain http on loopback, and the system's CAs (never used).
    plain = _child(_up_args(tmp_path), "sampler", {"trainer": 5000})
    assert plain.register_with == ["http://127.0.0.1:9443"] and plain.register_ca == ""


def test_up_s_gateway_workers_share_the_port_each_with_its_own_internal_listener(tmp_path):
    """--gateway-workers 2: both processes share --port (SO_REUSEPORT), each has an internal
    listener of its own, and every replica heart-beats at both."""
    args = _up_args(tmp_path, "--gateway-workers", "2")
    args.worker_internal_ports = {"gateway-2": 9444}          # free ones, fixed by `up` before anything starts
    first, second = (_child(args, name, {"trainer": 5000}) for name in up.gateway_names(args))
    assert (first.port, second.port, first.reuse_port, second.reuse_port) == (8443, 8443, True, True)
    assert (first.internal_port, second.internal_port) == (9443, 9444)
    replica = _child(args, "sampler", {"trainer": 5000})
    assert replica.register_with == ["http://127.0.0.1:9443", "http://127.0.0.1:9444"]
    assert not _child(_up_args(tmp_path), "gateway", {"trainer": 5000}).reuse_port     # one process: its own port


@pytest.mark.parametrize("url", ["http://gateway.internal:8001", "http://10.0.0.5:8001"])
def test_a_replica_with_tls_refuses_plain_http_to_another_host(url):
    with pytest.raises(SystemExit, match="in clear"):
        check_urls([url], tls=True)
    check_urls([url], tls=False)                      # no TLS anywhere: the operator's choice
    check_urls(["http://127.0.0.1:8001", "http://localhost:8001", "https://gateway.internal:8001"], tls=True)


@pytest.mark.parametrize("url", ["gateway:8001", "ftp://gateway:8001", "https://", "grpc://g:1"])
def test_a_register_with_that_is_no_http_url_is_refused(url):
    with pytest.raises(SystemExit, match="not an http"):
        check_urls([url], tls=False)


def test_the_registration_client_checks_certificate_and_name():
    import ssl

    context = client_context("")
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname


def test_the_admin_key_file_is_its_owner_s_only(tmp_path):
    old = tmp_path / "admin-api-key"
    old.write_text("stale")
    old.chmod(0o644)                                  # a file from before keeps no wider mode
    path = keys.write_key_file(str(tmp_path), "tml-abc-def")
    assert open(path).read().strip() == "tml-abc-def"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_the_database_password_comes_from_a_file_or_the_environment(tmp_path, monkeypatch):
    secret = tmp_path / "pw"
    secret.write_text("p@ss:w/rd\n")                  # characters a URL must escape
    url = database_url(str(tmp_path), "postgresql+psycopg://tinkerd@db/tinkerd", str(secret))
    assert sqlalchemy.engine.make_url(url).password == "p@ss:w/rd"
    monkeypatch.setenv("TINKERD_DB_URL", "postgresql+psycopg://u:pw@db/tinkerd")
    assert database_url(str(tmp_path), None) == "postgresql+psycopg://u:pw@db/tinkerd"
    assert database_url(str(tmp_path), "sqlite:///x.db") == "sqlite:///x.db"    # a flag wins
    monkeypatch.delenv("TINKERD_DB_URL")
    assert database_url(str(tmp_path), None).startswith("sqlite:///")
