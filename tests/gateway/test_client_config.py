"""client/config's per-client answers: whether the SDK compresses forward_backward
(--fwdbwd-compression: auto = not for a client on this host), on real Starlette requests."""

from __future__ import annotations

import pytest
from starlette.requests import Request

from gateway.routes.service import compresses


def _request(host: str | None, headers: dict[str, str] | None = None) -> Request:
    scope = {"type": "http", "method": "POST", "path": "/api/v1/client/config", "query_string": b"",
             "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()],
             "client": None if host is None else (host, 50000)}
    return Request(scope)


@pytest.mark.parametrize("host, headers, compressed", [
    ("127.0.0.1", {}, False),                                      # the SDK on this host
    ("::1", {}, False),
    ("127.0.0.2", {}, False),
    ("10.1.2.3", {}, True),                                        # elsewhere: the network is saved
    ("2001:db8::1", {}, True),
    ("127.0.0.1", {"X-Forwarded-For": "203.0.113.9"}, True),      # a proxy on this host for a client elsewhere
    ("127.0.0.1", {"Forwarded": "for=203.0.113.9"}, True),
    ("127.0.0.1", {"X-Real-IP": "203.0.113.9"}, True),
    (None, {}, True),                                              # unknown: as if elsewhere
    ("testclient", {}, True),                                      # not an address
])
def test_auto_compresses_unless_the_client_is_on_this_host(host, headers, compressed):
    assert compresses("auto", _request(host, headers)) is compressed


@pytest.mark.parametrize("host", ["127.0.0.1", "10.1.2.3"])
def test_on_and_off_are_for_every_client(host):
    assert compresses("on", _request(host)) is True
    assert compresses("off", _request(host)) is False
