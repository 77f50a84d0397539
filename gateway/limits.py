"""Per-user limits, so one user cannot take the service from the others. Over a limit that
frees up by waiting (queued requests, samples in flight) is HTTP 429 with Retry-After, which
the SDK backs off on and resends; over one that only the user can free (models in open
sessions, checkpoint bytes on disk) is a 400 that says what to do.

Every limit is counted in the database, so it holds across all the gateways on it: a user at
the limit on one gateway is at it on every other. Pending futures are counted through a
partial index that holds only pending rows (gateway/db.py ix_futures_pending)."""

from __future__ import annotations

from fastapi import Request
from sqlalchemy import func, select

from gateway.db import CheckpointRow, Database, ModelRow, SessionRow
from gateway.errors import error_response
from gateway.keys import Caller
from gateway.settings import GatewaySettings
from tinkerd.errors import UserError

RETRY_AFTER_S = 2


class OverLimit(Exception):
    """A limit that frees up by waiting: 429, with when to retry."""

    def __init__(self, message: str, retry_after_s: int = RETRY_AFTER_S):
        super().__init__(message)
        self.retry_after_s = retry_after_s


async def on_over_limit(request: Request, exc: OverLimit):
    return error_response(str(exc), 429, headers={"Retry-After": str(exc.retry_after_s)})


class Limits:
    def __init__(self, settings: GatewaySettings, db: Database):
        self.settings = settings
        self.db = db

    def check_queue(self, caller: Caller) -> None:
        queued = self.db.pending_training(caller.user_id)
        if queued >= self.settings.max_queued_per_user:
            raise OverLimit(f"{queued} of your training requests are queued (limit "
                            f"{self.settings.max_queued_per_user}); retry when some finish")

    def check_samples(self, caller: Caller) -> None:
        """The server's samples in flight (--max-pending-samples, all gateways), then the caller's."""
        queued, pending = self.db.pending_samples(caller.user_id)
        if queued >= self.settings.max_pending_samples:
            raise OverLimit(f"{queued} sample requests are queued; retry shortly", retry_after_s=1)
        if pending >= self.settings.max_samples_per_user:
            raise OverLimit(f"{pending} of your sample requests are in flight (limit "
                            f"{self.settings.max_samples_per_user}); retry when some finish")

    def check_models(self, caller: Caller) -> None:
        """Before a new training run: the user's runs in sessions that are still open."""
        live = self.db.count(select(ModelRow.model_id).join(SessionRow, SessionRow.session_id == ModelRow.session_id)
                             .where(ModelRow.owner == caller.user_id, SessionRow.finished.is_(False)))
        if live >= self.settings.max_models_per_user:
            raise UserError(f"you have {live} training runs in open sessions (limit "
                            f"{self.settings.max_models_per_user}); close a ServiceClient to free them")

    def check_checkpoint_bytes(self, caller: Caller) -> None:
        """Before a new checkpoint: what the user's checkpoints hold on disk."""
        with self.db.session() as s:
            used = s.scalar(select(func.coalesce(func.sum(CheckpointRow.size_bytes), 0))
                            .where(CheckpointRow.owner == caller.user_id)) or 0
        limit = int(self.settings.max_checkpoint_gb_per_user * 1e9)
        if used >= limit:
            raise UserError(f"your checkpoints hold {used / 1e9:.2f} GB (limit {limit / 1e9:g} GB); delete some "
                            f"(RestClient.delete_checkpoint) or give them a ttl")
