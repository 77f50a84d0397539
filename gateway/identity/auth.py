"""Authentication: every request is resolved to a Caller before any route runs (and before its
body is read), or refused with 401.

The SDK sends its credential as `X-API-Key`: an API key (`tml-…`), or, when client/config
advertises JWT auth, the token it got from `POST /api/v1/auth/token`. A token that is forged,
expired or whose key was revoked gets 401 with `WWW-Authenticate: Bearer error="invalid_token"`,
which makes the SDK exchange its key for a fresh one (and fail with AuthenticationError if the
key itself is no longer valid). Asked by the gateway's one middleware (gateway/edge.py).

The internal listener's routes (gateway/listeners.py) take an admin's credential; a tenant's is
refused with 403. The replicas' (`/internal/v1/samplers/`) take a sampler's service token
(tinkerd/service_roles.py; a trainer's or gateway's is refused with 403); joining or leaving the
pool takes only it (an organisation admin is no operator). Being on this machine counts for
nothing: a local user or a local reverse proxy is not the operator. Checked here too, so a bad credential is a 401 before any body
is read or bounded. A path on the wrong listener is a 404 before any credential is looked at.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Callable

from fastapi import Depends, Request
from starlette.responses import Response

from gateway import listeners
from gateway.errors import error_response
from gateway.identity.keys import Caller, KeyStore
from gateway.identity.tokens import Signer
from tinkerd import service_roles
from tinkerd.rpc import ServiceAuth

# Reachable without a credential: health probes, metrics scrapes (on the internal listener only),
# downloads that carry their own signature, and the console's page and files (no data: its script
# calls the API with the key the user enters).
PUBLIC_PATHS = ("/api/v1/healthz", "/metrics", "/console", "/console/")       # /metrics: gateway/metrics.py
PUBLIC_PREFIXES = ("/files/", "/console/static/")
INTERNAL_PREFIX = "/internal/"                  # admins only (internal_refusal) ...
REPLICA_PREFIX = "/internal/v1/samplers/"       # ... and, for replicas joining the pool, the service token


_LOOKUPS = ThreadPoolExecutor(2, thread_name_prefix="auth-lookup")


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

    async def caller_off_loop(self, credential: str) -> tuple[Caller | None, bool]:
        """`caller`, reading the database (a key not looked up lately, perhaps a made-up one) in
        a small pool of its own: never on the event loop, and a flood of unknown keys waits
        there without holding up the threads other work runs in."""
        is_token = not credential.startswith("tml-")
        if is_token:     # a signature check (no database), done once: the lookup takes its key id
            key_id = self.signer.token_key_id(credential)
            lookup = functools.partial(self.keys.caller_for_key_id, key_id)
        else:
            key_id, lookup = self.keys.key_id_of(credential), functools.partial(self.keys.caller_for_key, credential)
        if not key_id:
            return None, is_token
        if self.keys.cached(key_id):
            return lookup(), is_token
        return await asyncio.get_running_loop().run_in_executor(_LOOKUPS, lookup), is_token


def _credential(scope) -> str:
    for name, value in scope.get("headers", ()):
        if name == b"x-api-key":
            return value.decode("latin-1").strip()
        if name == b"authorization" and value[:7].lower() == b"bearer ":
            return value[7:].decode("latin-1").strip()
    return ""


def internal_refusal(service_auth: ServiceAuth | None, auth: Authenticator,
                     scope) -> tuple[tuple[int, str] | None, Caller | None]:
    """(why a caller of an internal route is refused, or None; the admin it acts as, None for a
    replica). The replicas' routes take a sampler's service token (or the operator's secret) as a
    bearer credential; every internal route takes an admin's API key or token."""
    credential = _credential(scope)
    path = scope.get("path", "")
    replica_route = path.startswith(REPLICA_PREFIX)
    # Joining or leaving the pool makes the gateway dial an address with its token and the
    # trainer push adapters there: the operator's credential only (an organisation admin is not one).
    operator_only = replica_route and path != REPLICA_PREFIX + "list"
    wanted = ("the service token (Authorization: Bearer)" if operator_only else
              "the service token (Authorization: Bearer) or an admin's API key" if replica_route else
              "an admin's API key")
    if not credential:
        return (401, f"missing credential: {wanted}"), None
    role = service_auth.caller_role(credential, "gateway") if replica_route and service_auth else ""
    if role:
        if service_roles.allows("gateway", role, path):
            return None, None
        return (403, f"the {role} service's token does not open {path} (it opens "
                     f"{service_roles.opens('gateway', role)})"), None
    if replica_route and (claimed := service_roles.role_of(credential)):
        # A service's token that this gateway's secret did not make: named, the secret never.
        return (403, f"the {claimed} service's token is not one this gateway accepts: a service token mismatch "
                     f"(every host needs the same service secret in --service-token-file, or a credential "
                     f"made from it)"), None
    if operator_only:
        return (403, f"{path} takes {wanted}, not an API key"), None
    caller, _ = auth.caller(credential)
    if caller is None:
        return (401, f"wrong credential: {wanted}"), None
    if not caller.admin:
        return (403, f"internal routes take {wanted}, not a user's key"), None
    return None, caller


def _refusal(message: str, invalid_token: bool, status: int = 401) -> Response:
    return error_response(message, status, {"www-authenticate": 'Bearer error="invalid_token"'} if invalid_token
                          else None)


class Authentication:
    """Who a request is, before its body is read (gateway/edge.py asks): the Caller put in the
    scope's state, or the refusal to answer with."""

    def __init__(self, authenticator: Authenticator, service_auth: Callable[[], ServiceAuth | None]):
        self.auth = authenticator
        self.service_auth = service_auth

    async def refusal(self, scope) -> Response | None:
        path = scope.get("path", "")
        misplaced = listeners.misplaced(scope)
        if misplaced is not None:
            return _refusal(misplaced, False, 404)
        if path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES):
            return None
        if path.startswith(INTERNAL_PREFIX):
            refusal, admin = internal_refusal(self.service_auth(), self.auth, scope)
            if refusal is not None:
                return _refusal(refusal[1], False, refusal[0])
            if admin is not None:
                scope.setdefault("state", {})["caller"] = admin
            return None
        caller = self.auth.anonymous
        if caller is None:
            credential = _credential(scope)
            if not credential:
                return _refusal("missing API key: set TINKER_API_KEY (tinkerd keys create)", False)
            caller, is_token = await self.auth.caller_off_loop(credential)
            if caller is None:
                return _refusal("expired or invalid token" if is_token else "unknown or revoked API key", is_token)
        scope.setdefault("state", {})["caller"] = caller
        return None


def caller_of(request: Request) -> Caller:
    return request.state.caller


async def _caller_dependency(request: Request) -> Caller:
    """caller_of for Depends: async, so FastAPI calls it inline (a plain def runs in its thread pool)."""
    return request.state.caller


CallerDep = Annotated[Caller, Depends(_caller_dependency)]
