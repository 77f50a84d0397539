"""The gateway's runtime parts, made once per process and reached by every route through the
`GatewayDep` dependency (routes are plain module-level functions, not closures)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy import text

from gateway.backends import Backends
from gateway.futures.store import Futures
from gateway.identity.auth import Authenticator
from gateway.identity.keys import Caller, KeyStore, create_user
from gateway.identity.limits import Limits
from gateway.identity.signing_keys import KeyRing
from gateway.identity.tokens import Signer
from gateway.jobs.engine import Jobs
from gateway.sessions import Sessions
from gateway.settings import GatewaySettings
from gateway.stability import StabilityRecords
from gateway.storage import state_dir
from gateway.storage.db import Database
from gateway.traces.spans import Traces
from tinkerd.errors import NotFoundError, UserError
from tinkerd.rpc import ServiceAuth

# The user a fresh database starts with: `tinkerd up` gives it the first API key, rows made
# before users existed become its, and with --no-auth every request acts as it.
ADMIN_USER = "admin"


@dataclasses.dataclass
class Gateway:
    settings: GatewaySettings
    db: Database
    sessions: Sessions
    futures: Futures
    stability: StabilityRecords
    authenticator: Authenticator
    limits: Limits
    backends: Backends | None = None          # made on startup, inside the event loop
    jobs: Jobs | None = None                  # what the routes hand work to, made by gateway/app.py
    background: set[asyncio.Task] = dataclasses.field(default_factory=set)

    @classmethod
    def create(cls, settings: GatewaySettings) -> "Gateway":
        keys_file = state_dir.prepare(settings)          # refuses a state dir others may read
        db = Database(settings.database_url)
        forget_database_secret(db)
        admin = create_user(db, ADMIN_USER, admin=True)
        db.adopt_unowned(admin.user_id)
        anonymous = None if settings.auth else Caller(admin.user_id, admin.name, admin.org_id, admin.email,
                                                      True, key_id="")
        authenticator = Authenticator(KeyStore(db), Signer(KeyRing(keys_file), settings.token_ttl_s), anonymous)
        futures = Futures(db, lease_s=settings.future_lease_s,
                          traces=Traces(db, per_session=settings.trace_spans_per_session))
        stability = StabilityRecords(db, ttl_s=settings.stability_ttl_s,
                                     max_bytes_per_user=int(settings.stability_mb_per_user * (1 << 20)))
        gw = cls(settings, db, Sessions(db, settings), futures, stability, authenticator, Limits(settings, db))
        return gw

    @property
    def trainer(self):
        return self.backends.trainer

    def in_background(self, coroutine) -> None:
        """Runs a coroutine to completion, holding it (the loop keeps only weak references)."""
        task = asyncio.create_task(coroutine)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    @functools.cached_property
    def service_auth(self) -> ServiceAuth:
        """The credentials services present to each other (and replicas to the gateway)."""
        return ServiceAuth.of(self.settings, role="gateway")

    @property
    def traces(self) -> Traces:
        return self.futures.traces

    @property
    def signer(self) -> Signer:
        return self.authenticator.signer

    async def is_resend(self, kind: str, model_id: str, seq_id: int) -> bool:
        """Whether a `kind` request with (model_id, seq_id) was submitted already (read on the
        database's threads): a route skips the checks that only a first send must pass (a named
        checkpoint that this very request created exists now), and Jobs.submit answers it with the
        first one's future, or refuses it if its content differs."""
        return await self.db.run(self.futures.store.type_by_key, f"{model_id}#{seq_id}") == kind

    @contextlib.asynccontextmanager
    async def refusing(self, caller: Caller, model_id: str, seq_id: int):
        """Checks of a model's request (model_id, seq_id) run inside: a user error they raise still
        answers the client at once, and the seq_id is recorded as refused in the model's order
        (Jobs.refuse), so the model's next request does not wait for it."""
        try:
            yield
        except UserError as e:
            if not isinstance(e, NotFoundError):
                await self.jobs.refuse(caller, model_id, seq_id, str(e))
            raise


def forget_database_secret(db: Database) -> None:
    """Gateways before the signing keys file kept their one secret in `server_secrets`, in a database
    others could often read: the secret is dropped, never moved to the file (whoever read it could
    forge tokens with it). Migration 0006 drops the table; this covers a database from before
    migrations, which is stamped at the newest revision without running them. Tokens and URLs that
    the old secret signed stop working: the SDK exchanges its API key for a new token by itself."""
    with db.engine.begin() as conn:
        conn.execute(text("DROP TABLE IF EXISTS server_secrets"))


def gateway_of(request: Request) -> Gateway:
    return request.app.state.gateway


async def _gateway_dependency(request: Request) -> Gateway:
    """gateway_of for Depends: async, so FastAPI calls it inline (a plain def runs in its thread pool)."""
    return gateway_of(request)


GatewayDep = Annotated[Gateway, Depends(_gateway_dependency)]
