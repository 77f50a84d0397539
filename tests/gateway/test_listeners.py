"""The gateway's two listeners (gateway/listeners.py) and who may use the internal one
(gateway/identity/auth.py), on fake backends: /metrics and /internal/ are not on the users' port; on the
internal listener they take the service token or an admin's key, a tenant's key is refused, and
being on this machine counts for nothing. And the base of the URLs the gateway hands out
(gateway/public_url.py): --public-url, a --trusted-proxy's forwarded headers, never anyone else's."""

from __future__ import annotations

import re
import urllib.parse

import pytest
from fastapi.testclient import TestClient

from gateway.app import create_app
from gateway.identity import keys
from gateway.listeners import INTERNAL, Listener
from conftest import self_signed
from gateway_fakes import Api, FakeSampler, FakeTrainer, assert_user_error, fake_services

TOKEN = "listeners-service-token"


@pytest.fixture
def gw(tmp_path, request):
    """(public client, internal client, admin key, tenant key, settings)."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    overrides = getattr(request, "param", {})
    overrides = {"service_token_file": str(token_file), **overrides}
    with fake_services(tmp_path, FakeTrainer(str(tmp_path / "state")), FakeSampler(), **overrides) as settings:
        app = create_app(settings)
        # The lifespan runs once, under the public client; the internal one shares its app.
        with TestClient(app) as public:
            internal = TestClient(Listener(app, INTERNAL), client=("127.0.0.1", 50001))
            db = app.state.gateway.db
            admin, _ = keys.create_key(db, keys.create_user(db, "root", admin=True))
            tenant, _ = keys.create_key(db, keys.create_user(db, "tenant"))
            yield public, internal, admin, tenant, settings


def test_metrics_and_internal_routes_are_not_on_the_public_port(gw):
    public, _, admin, tenant, _ = gw
    for headers in ({}, {"X-API-Key": tenant}, {"X-API-Key": admin}, {"authorization": f"Bearer {TOKEN}"}):
        assert_user_error(public.get("/metrics", headers=headers), 404, "no route /metrics")
        assert_user_error(public.get("/internal/v1/samplers/list", headers=headers), 404)
        assert_user_error(public.post("/internal/v1/samplers/register", json={"address": "10.0.0.1:5"},
                                      headers=headers), 404)
    assert public.get("/api/v1/healthz").status_code in (200, 503)     # the public routes stay


def test_the_internal_listener_serves_metrics_and_internal_routes_only(gw):
    _, internal, admin, _, _ = gw
    scrape = internal.get("/metrics")              # a scraper has no key; the listener is private
    assert scrape.status_code == 200 and "tinkerd_gateway_requests_total" in scrape.text
    for path in ("/api/v1/healthz", "/console", "/api/v1/get_server_capabilities"):
        assert_user_error(internal.get(path, headers={"X-API-Key": admin}), 404, "internal listener")


def test_internal_routes_take_the_service_token_or_an_admin_and_refuse_a_tenant(gw):
    _, internal, admin, tenant, _ = gw
    listing = "/internal/v1/samplers/list"
    assert_user_error(internal.get(listing), 401, "missing credential")     # from 127.0.0.1: no matter
    assert_user_error(internal.get(listing, headers={"authorization": "Bearer wrong"}), 401, "wrong credential")
    assert_user_error(internal.get(listing, headers={"authorization": "Bearer tml-unknown"}), 401)
    assert_user_error(internal.get(listing, headers={"X-API-Key": tenant}), 403, "admin")
    assert_user_error(internal.get(listing, headers={"authorization": f"Bearer {tenant}"}), 403, "admin")
    assert_user_error(internal.post("/internal/v1/samplers/register", json={"address": "10.0.0.9:5"},
                                    headers={"X-API-Key": tenant}), 403)
    assert internal.get(listing, headers={"authorization": f"Bearer {TOKEN}"}).status_code == 200
    assert internal.get(listing, headers={"X-API-Key": admin}).status_code == 200
    assert internal.post("/internal/v1/samplers/register", json={"address": "10.0.0.9:5"},
                         headers={"authorization": f"Bearer {TOKEN}"}).json() == {"status": "registered"}
    # An organisation admin may list the pool, not change it: registering would make the gateway
    # dial any address with the service token, and the trainer push adapters there.
    for action in ("register", "deregister"):
        assert_user_error(internal.post(f"/internal/v1/samplers/{action}", json={"address": "10.0.0.66:5"},
                                        headers={"X-API-Key": admin}), 403, "service token")
    # The other internal routes (benchmarks' no-op futures, futures stats) are an admin's only: the
    # service token is for replicas joining the pool.
    for credential, status in ((TOKEN, 401), (tenant, 403)):
        assert_user_error(internal.get("/internal/futures_stats", headers={"authorization": f"Bearer {credential}"}),
                          status, "admin")
        assert_user_error(internal.post("/internal/noop_future", headers={"X-API-Key": credential}), status)
    assert "calls" in internal.get("/internal/futures_stats", headers={"X-API-Key": admin}).json()
    # A non-ASCII credential is a 401, not a 500.
    assert internal.get(listing, headers={"authorization": "Bearer \u00e9t\u00e9".encode("latin-1")}).status_code == 401


@pytest.mark.parametrize("gw", [{"service_token_file": ""}], indirect=True)
def test_without_a_service_token_a_loopback_peer_is_not_authenticated(gw):
    _, internal, admin, tenant, _ = gw
    listing = "/internal/v1/samplers/list"
    assert_user_error(internal.get(listing), 401, "missing credential")
    assert_user_error(internal.post("/internal/v1/samplers/register", json={"address": "127.0.0.1:5"}), 401)
    assert_user_error(internal.get(listing, headers={"X-API-Key": tenant}), 403)
    assert internal.get(listing, headers={"X-API-Key": admin}).status_code == 200


def _archive_url(public: TestClient, tenant: str, via: TestClient | None = None, **headers) -> str:
    """The download URL of a new checkpoint, asked for through `via` (another peer), else `public`."""
    api = Api(public, tenant)
    model_id = api.model(api.session())
    api.result(api.post("save_weights", {"model_id": model_id, "seq_id": 1, "path": "c1"}).json())
    # Only this call through `via`: its portal runs another event loop than the gRPC channels'.
    r = Api(via or public, tenant).get(f"training_runs/{model_id}/checkpoints/weights/c1/archive",
                                       follow_redirects=False, headers=headers)
    assert r.status_code == 302, r.text
    return r.headers["location"]


def test_urls_use_the_request_s_scheme_and_host_and_ignore_an_untrusted_proxy_s_headers(gw):
    public, _, _, tenant, _ = gw
    url = _archive_url(public, tenant, **{"x-forwarded-proto": "https", "x-forwarded-host": "evil.example"})
    assert url.startswith("http://testserver/files/"), url


@pytest.mark.parametrize("gw", [{"public_url": "https://tinker.example.com/prefix/"}], indirect=True)
def test_urls_use_the_public_url(gw):
    public, _, _, tenant, _ = gw
    url = _archive_url(public, tenant, **{"x-forwarded-host": "evil.example"})
    parts = urllib.parse.urlsplit(url)
    assert (parts.scheme, parts.netloc) == ("https", "tinker.example.com") and parts.path.startswith("/prefix/files/")


@pytest.mark.parametrize("gw", [{"trusted_proxies": ["10.0.0.0/8"]}], indirect=True)
def test_a_trusted_proxy_s_forwarded_headers_make_the_url(gw):
    public, _, _, tenant, _ = gw
    # TestClient's default peer is "testclient": not a trusted address.
    assert _archive_url(public, tenant, **{"x-forwarded-proto": "https"}).startswith("http://testserver/")
    proxy = TestClient(public.app, client=("10.1.2.3", 443))
    url = _archive_url(public, tenant, proxy, **{"x-forwarded-proto": "https, http",
                                                 "x-forwarded-host": "api.example:8443"})
    assert url.startswith("https://api.example:8443/files/"), url
    # A forwarded host that is not a host[:port] (header injection into the link) is ignored.
    url = _archive_url(public, tenant, proxy, **{"x-forwarded-proto": "javascript", "x-forwarded-host": "a/b@evil"})
    assert url.startswith("http://testserver/files/"), url


@pytest.mark.parametrize("public_url, proxies, words", [
    ("tinker.example.com", [], "absolute http(s) URL"),
    ("ftp://tinker.example.com", [], "absolute http(s) URL"),
    ("https://tinker.example.com/?a=1", [], "without query"),
    ("", ["proxy.local"], "not an IP address or network"),
    ("", ["10.0.0.0/33"], "not an IP address or network"),
])
def test_bad_public_url_or_proxy_settings_are_refused_at_start(public_url, proxies, words):
    from gateway.server import check_listeners
    from gateway.settings import GatewaySettings

    settings = GatewaySettings(base_model="b", trainer="t:1", public_url=public_url, trusted_proxies=proxies)
    with pytest.raises(SystemExit, match=re.escape(words)):
        check_listeners(settings)


def test_the_internal_listener_needs_a_port_of_its_own():
    from gateway.server import check_listeners
    from gateway.settings import GatewaySettings

    with pytest.raises(SystemExit, match="a port of its own"):
        check_listeners(GatewaySettings(base_model="b", trainer="t:1", port=8000, internal_port=8000))
    check_listeners(GatewaySettings(base_model="b", trainer="t:1", port=0, internal_port=0))


def test_two_gateway_processes_share_a_port_when_both_set_reuse_port():
    """--reuse-port (`tinkerd up --gateway-workers N`): a second gateway process binds the port a
    first one listens on, and passes the start-up check of it; without it, both are refused."""
    from launcher.up import free_port

    from gateway.server import _listening_socket, check_listeners
    from gateway.settings import GatewaySettings

    port = free_port()
    first = _listening_socket("127.0.0.1", port, "--host/--port", reuse_port=True)
    first.listen()
    try:
        check_listeners(GatewaySettings(base_model="b", trainer="t:1", port=port, reuse_port=True))
        _listening_socket("127.0.0.1", port, "--host/--port", reuse_port=True).close()
        with pytest.raises(SystemExit, match=f"cannot listen on 127.0.0.1:{port}"):
            check_listeners(GatewaySettings(base_model="b", trainer="t:1", port=port))
    finally:
        first.close()


def test_https_cert_and_key_go_together(tmp_path):
    from gateway.server import check_listeners
    from gateway.settings import GatewaySettings

    cert = tmp_path / "cert.pem"
    cert.write_text("x")
    with pytest.raises(SystemExit, match="go together"):
        check_listeners(GatewaySettings(base_model="b", trainer="t:1", https_cert=str(cert)))
    with pytest.raises(SystemExit, match="is not a file"):
        check_listeners(GatewaySettings(base_model="b", trainer="t:1", https_cert=str(cert),
                                    https_key=str(tmp_path / "missing.pem")))


def test_the_sdk_is_told_to_use_pyqwest_only_on_cpython_3_14_and_where_rustls_accepts_the_certificate(tmp_path, capsys):
    """SDK 0.38's default transport (pyqwest: rustls) refuses a CA certificate as a server's
    (CaUsedAsEndEntity; OpenSSL and httpx accept it): over https with one, the official SDK
    failed after six minutes of retries. Such a gateway sends its SDKs to httpx and says so at
    start. And before CPython 3.14 a pyqwest thread handing over the SDK's last answer as the
    script exits aborts the client (exit 134; CI's SDK 0.35 whoami and 0.38 `tinker billing`):
    those clients, and any that do not name their interpreter, get httpx whatever the certificate."""
    import asyncio
    import types

    from gateway.routes.service import client_config
    from gateway.server import check_listeners
    from gateway.settings import GatewaySettings

    (tmp_path / "leaf").mkdir()
    (tmp_path / "ca").mkdir()
    (leaf, leaf_key), (ca, ca_key) = self_signed(tmp_path / "leaf"), self_signed(tmp_path / "ca", ca=True)
    chain = tmp_path / "chain.pem"
    chain.write_text(open(leaf).read() + open(ca).read())       # the server's own first, as PEM chains are
    clients = {"3.14.0": True, "3.15.1": True, "3.13.9": False, "3.11.7": False, "unknown": False, None: False}
    for tls, rustls_reaches in (({}, True), ({"https_cert": leaf, "https_key": leaf_key}, True),
                                ({"https_cert": str(chain), "https_key": leaf_key}, True),
                                ({"https_cert": ca, "https_key": ca_key}, False)):
        settings = GatewaySettings(base_model="b", trainer="t:1", port=0, internal_port=0, **tls)
        for python, safe in clients.items():
            headers = {"x-stainless-runtime": "CPython", "x-stainless-runtime-version": python} if python else {}
            request = types.SimpleNamespace(headers=headers, client=None)
            config = asyncio.run(client_config(request, types.SimpleNamespace(settings=settings)))
            assert config["use_pyqwest_transport"] is (safe and rustls_reaches), (tls, python, config)
        pypy = types.SimpleNamespace(headers={"x-stainless-runtime": "PyPy", "x-stainless-runtime-version": "3.14.0"},
                                     client=None)
        config = asyncio.run(client_config(pypy, types.SimpleNamespace(settings=settings)))
        assert config["use_pyqwest_transport"] is False, config
        check_listeners(settings)
        said = capsys.readouterr().err
        assert ("is a CA certificate" in said and "use httpx instead" in said) is (not rustls_reaches), said
