"""The base of every URL the gateway hands out (checkpoint downloads): --public-url when given
(the address clients reach, e.g. behind a TLS-terminating proxy); else, for a request from a
--trusted-proxy, its X-Forwarded-Proto and X-Forwarded-Host; else the request's own scheme (https
when the gateway serves HTTPS) and Host. Forwarded headers from anyone else are ignored: a client
could otherwise point the links a gateway hands out anywhere."""

from __future__ import annotations

import functools
import ipaddress
import re
import urllib.parse

from starlette.requests import Request

# host, IPv4 or [IPv6], with an optional port: nothing else may reach a URL from a header.
_HOST = re.compile(r"^(?:[A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?$")


def check(public_url: str, trusted_proxies: list[str]) -> str | None:
    """What is wrong with these settings, or None."""
    if public_url:
        parts = urllib.parse.urlsplit(public_url)
        if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
            return f"--public-url {public_url!r} must be an absolute http(s) URL without query, e.g. " \
                   f"https://tinker.example.com"
    for proxy in trusted_proxies:
        try:
            ipaddress.ip_network(proxy, strict=False)
        except ValueError:
            return f"--trusted-proxy {proxy!r} is not an IP address or network (e.g. 10.0.0.5 or 10.0.0.0/8)"
    return None


@functools.lru_cache(maxsize=8)
def _networks(proxies: tuple[str, ...]) -> tuple:
    return tuple(ipaddress.ip_network(p, strict=False) for p in proxies)


def _trusted(peer: str | None, proxies: list[str]) -> bool:
    if not peer or not proxies:
        return False
    try:
        address = ipaddress.ip_address(peer)
    except ValueError:
        return False
    return any(address in net for net in _networks(tuple(proxies)))


def _first(value: str | None) -> str:
    """The first (the client-side proxy's) value of a comma-separated forwarded header."""
    return (value or "").split(",")[0].strip()


def base_url(request: Request, settings) -> str:
    """scheme://host[:port][/prefix], without a trailing slash."""
    if settings.public_url:
        return settings.public_url.rstrip("/")
    base = str(request.base_url).rstrip("/")
    if _trusted(request.client.host if request.client else None, settings.trusted_proxies):
        parts = urllib.parse.urlsplit(base)
        proto = _first(request.headers.get("x-forwarded-proto")).lower()
        host = _first(request.headers.get("x-forwarded-host"))
        scheme = proto if proto in ("http", "https") else parts.scheme
        netloc = host if _HOST.match(host) else parts.netloc
        return urllib.parse.urlunsplit((scheme, netloc, parts.path, "", "")).rstrip("/")
    return base
