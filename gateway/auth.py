"""Authentication: every request is resolved to a Caller before any route runs (and before its
body is read), or refused with 401.

The SDK sends its credential as `X-API-Key`: an API key (`tml-…`), or, when client/config
advertises JWT auth, the token it got from `POST /api/v1/auth/token`. A token that is forged,
expired or whose key was revoked gets 401 with `WWW-Authenticate: Bearer error="invalid_token"`,
which makes the SDK exchange its key for a fresh one (and fail with AuthenticationError if the
key itself is no longer valid). A plain ASGI middleware: it is on the futures hot path.

The sampler replicas' routes (`/internal/v1/samplers/`: joining the pool) take the service token
that the services' gRPC calls carry instead of an API key; without one configured, only callers on this
machine. Checked here too, so a bad credential is a 401 before any body is read or bounded.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from typing import Annotated, Callable

from fastapi import Depends, Request

from gateway.errors import error_body
from gateway.keys import Caller, KeyStore
from gateway.tokens import Signer

# Reachable without a credential: health probes, metrics scrapes, downloads that carry their own
# signature, and the console's page and files (no data: its script calls the API with the key the
# user enters).
PUBLIC_PATHS = ("/api/v1/healthz", "/metrics", "/console", "/console/")       # /metrics: gateway/metrics.py
PUBLIC_PREFIXES = ("/files/", "/console/static/")
SERVICE_PREFIX = "/internal/v1/samplers/"   # replicas joining the pool: the service token (service_refusal)


class Authenticator:
    def __init__(self, keys: KeyStore, signer: Signer, anonymous: Caller | None):
        self.keys = keys
        self.signer = signer
        self.anonymous = anonymous       # with auth off (--no-auth): who every request acts as

    def caller(self, credential: str) -> tuple[Caller | None, bool]:
        """(the caller, whether a bad credential was a token the SDK should replace)."""
        if credential.startswith("tml-"):
            return self.keys.caller_for_key(credential), False
        key_id = self.signer.token_key_id(credential)
        return (self.keys.caller_for_key_id(key_id) if key_id else None), True


def _credential(scope) -> str:
    for name, value in scope.get("headers", ()):
        if name == b"x-api-key":
            return value.decode("latin-1").strip()
        if name == b"authorization" and value[:7].lower() == b"bearer ":
            return value[7:].decode("latin-1").strip()
    return ""


def service_refusal(token: str | None, scope) -> tuple[int, str] | None:
    """Why a caller of a replicas' route is refused, or None: it must present the service token
    as a bearer credential or, where none is configured, call from this machine."""
    if token:
        given = dict(scope.get("headers", ())).get(b"authorization", b"")
        return None if hmac.compare_digest(given, f"Bearer {token}".encode()) else (
            401, "missing or wrong service token")
    client = scope.get("client")
    try:
        local = bool(client) and ipaddress.ip_address(client[0]).is_loopback
    except ValueError:          # a host name, not an address
        local = False
    return None if local else (403, "without a service token, replicas may register from this machine only")


async def _refuse(send, message: str, invalid_token: bool, status: int = 401) -> None:
    headers = [(b"content-type", b"application/json")]
    if invalid_token:
        headers.append((b"www-authenticate", b'Bearer error="invalid_token"'))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": json.dumps(error_body(message, "user")).encode()})


class AuthMiddleware:
    def __init__(self, app, authenticator: Authenticator, service_token: Callable[[], str | None]):
        self.app = app
        self.auth = authenticator
        self.service_token = service_token

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES):
            return await self.app(scope, receive, send)
        if path.startswith(SERVICE_PREFIX):
            refusal = service_refusal(self.service_token(), scope)
            if refusal is not None:
                return await _refuse(send, refusal[1], False, refusal[0])
            return await self.app(scope, receive, send)
        caller = self.auth.anonymous
        if caller is None:
            credential = _credential(scope)
            if not credential:
                return await _refuse(send, "missing API key: set TINKER_API_KEY (tinkerd keys create)", False)
            caller, is_token = self.auth.caller(credential)
            if caller is None:
                what = "expired or invalid token" if is_token else "unknown or revoked API key"
                return await _refuse(send, what, is_token)
        scope.setdefault("state", {})["caller"] = caller
        return await self.app(scope, receive, send)


def caller_of(request: Request) -> Caller:
    return request.state.caller


async def _caller_dependency(request: Request) -> Caller:
    """caller_of for Depends: async, so FastAPI calls it inline (a plain def runs in its thread pool)."""
    return request.state.caller


CallerDep = Annotated[Caller, Depends(_caller_dependency)]
