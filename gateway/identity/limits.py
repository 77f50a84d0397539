"""Per-user limits, so one user cannot take the service from the others. Over a limit that
frees up by waiting (queued requests, samples in flight) is HTTP 429 with Retry-After, which
the SDK backs off on and resends; over one that only the user can free (models and sessions
open, checkpoint bytes on disk) is a 400 that says what to do and names the flag.

Every limit is counted in the database, so it holds across all the gateways on it: a user at
the limit on one gateway is at it on every other. Pending futures are counted through a
partial index that holds only pending rows (gateway/storage/db.py ix_futures_pending).

What a request adds is counted with it: the future (or session) is inserted, the user's total
counted in the same transaction, and the insert rolled back if that is over a limit
(Database.owner_turn takes these transactions one user at a time, on every gateway). A burst of
requests therefore gets exactly the limit through, however many gateways it is spread over: a
training run counts from its create_model (not once the trainer has made it), and a save
reserves disk from when it is queued.
"""

from __future__ import annotations

from typing import Callable

from fastapi import Request
from sqlalchemy import delete, func, select
from sqlalchemy.engine import Connection

from gateway.errors import OverLimit, error_response      # noqa: F401 - OverLimit: limits' refusals
from gateway.identity.caller import Caller
from gateway.settings import GatewaySettings
from gateway.storage.db import NEW_RUN_TYPES, SAVE_TYPES, Database, ExportPlaceRow, now
from tinkerd.errors import UserError


Admit = Callable[[Connection], None]     # raises to refuse (Database.insert_future, add_admitted)


async def on_over_limit(request: Request, exc: OverLimit):
    return error_response(str(exc), 429, headers={"Retry-After": str(exc.retry_after_s)})


class Limits:
    def __init__(self, settings: GatewaySettings, db: Database):
        self.settings = settings
        self.db = db

    def admit_training(self, caller: Caller, request_type: str, model_id: str | None) -> Admit:
        """What admits a training request's future (Database.insert_future): the queue, and for a
        new run the model cap, for a save the checkpoint quota."""
        def admit(conn: Connection) -> None:
            # What only the user can free first (a 400 that says how), then what waiting frees (429).
            if request_type in NEW_RUN_TYPES and not self.db.run_exists(conn, model_id):
                self._admit_run(conn, caller)
            if request_type in SAVE_TYPES:
                self._admit_save(conn, caller)
            queued = self.db.pending_training_in(conn, caller.user_id) - 1
            if queued >= self.settings.max_queued_per_user:
                raise OverLimit(f"{queued} of your training requests are queued (limit "
                                f"{self.settings.max_queued_per_user}, --max-queued-per-user); retry when some "
                                f"finish")
            held = self.db.pending_training_bytes_in(conn, caller.user_id)
            if held > self.settings.max_queued_mib_per_user << 20:
                raise OverLimit(f"your queued training requests hold {held / 2**20:.1f} MiB (limit "
                                f"{self.settings.max_queued_mib_per_user} MiB, --max-queued-mib-per-user); retry "
                                f"when some finish")
        return admit

    def _admit_run(self, conn: Connection, caller: Caller) -> None:
        runs = self.db.runs_of(conn, caller.user_id) - 1
        if runs >= self.settings.max_models_per_user:
            raise UserError(f"you have {runs} training runs in open sessions or being created (limit "
                            f"{self.settings.max_models_per_user}, --max-models-per-user); close a ServiceClient "
                            f"to free them")

    def _admit_save(self, conn: Connection, caller: Caller) -> None:
        """The user's checkpoints and ephemeral snapshots on disk, plus what their other queued
        saves will write: each reserves the size of the user's largest save so far. While that
        is unknown (none finished yet) one save at a time is queued."""
        used, largest, pending = self.db.stored_bytes(conn, caller.user_id)
        self._refuse_over_quota(used, largest * (pending - 1), pending - 1)
        if pending > 1 and largest == 0:
            raise OverLimit("your first checkpoint save is still running, and its size sets what each queued save "
                            "reserves of --max-checkpoint-gb-per-user; retry when it finished")

    def _refuse_over_quota(self, used: int, reserved: int, queued: int) -> None:
        limit = int(self.settings.max_checkpoint_gb_per_user * 1e9)
        if used + reserved >= limit:
            queued_part = f" and {queued} queued saves reserve {reserved / 1e9:.2f} GB" if queued else ""
            raise UserError(f"your checkpoints and snapshots hold {used / 1e9:.2f} GB{queued_part} (limit "
                            f"{limit / 1e9:g} GB, --max-checkpoint-gb-per-user); delete some "
                            f"(RestClient.delete_checkpoint) or give them a ttl; the snapshots of "
                            f"save_weights_and_get_sampling_client go once unused "
                            f"{self.settings.superseded_snapshot_retention_s:.0f} s after a newer one")

    def admit_queued(self, caller: Caller) -> Admit:
        """Other futures of the training queue (unload_model, noop): the queue cap only."""
        return self.admit_training(caller, "", None)

    def admit_session(self, caller: Caller) -> Admit:
        def admit(conn: Connection) -> None:
            sessions = self.db.open_sessions(conn, caller.user_id) - 1
            if sessions >= self.settings.max_sessions_per_user:
                raise UserError(f"you have {sessions} open sessions (limit {self.settings.max_sessions_per_user}, "
                                f"--max-sessions-per-user); close the ServiceClients you no longer use, or "
                                f"POST /api/v1/sessions/<session_id>/finish for those listed by GET /api/v1/sessions")
        return admit

    def admit_sampling_session(self, caller: Caller) -> Admit:
        def admit(conn: Connection) -> None:
            open_ = self.db.open_sampling_sessions(conn, caller.user_id) - 1
            if open_ >= self.settings.max_sampling_sessions_per_user:
                raise UserError(f"you have {open_} sampling sessions in open sessions (limit "
                                f"{self.settings.max_sampling_sessions_per_user}, --max-sampling-sessions-per-user); "
                                f"reuse a SamplingClient, or close its ServiceClient to free them")
        return admit

    def admit_sample(self, caller: Caller) -> Admit:
        """What admits a sample's future (Database.insert_future): the server's samples in flight
        (--max-pending-samples, every user on every gateway), then the caller's. The server-wide
        count is taken one sample at a time (Database.samples_turn), so a burst of several users
        cannot pass it either."""
        def admit(conn: Connection) -> None:
            self.db.samples_turn(conn)
            queued, pending = self.db.pending_samples_in(conn, caller.user_id)
            if queued > self.settings.max_pending_samples:
                raise OverLimit(f"{queued - 1} sample requests are queued (limit {self.settings.max_pending_samples}, "
                                f"--max-pending-samples); retry shortly", retry_after_s=1)
            if pending > self.settings.max_samples_per_user:
                raise OverLimit(f"{pending - 1} of your sample requests are in flight (limit "
                                f"{self.settings.max_samples_per_user}); retry when some finish")
        return admit

    def admit_copy(self, caller: Caller, size: int) -> Admit:
        """What admits a copied checkpoint's row (copy_weights, outside the queue): the quota as it
        was before this copy of `size` bytes, counted with the row, so a burst of copies passes it
        no more than a burst of saves does."""
        def admit(conn: Connection) -> None:
            used, largest, pending = self.db.stored_bytes(conn, caller.user_id)
            self._refuse_over_quota(used - size, largest * pending, pending)
        return admit

    def admit_export(self, owner: str, limit: int) -> Admit:
        """What admits a merged export's place (an ExportPlaceRow of `owner`'s checkpoints, added
        with Database.add_admitted): at most `limit` of the owner's on every gateway, the new one
        counted; places whose lease lapsed (their gateway gone) are dropped first."""
        def admit(conn: Connection) -> None:
            places = ExportPlaceRow.__table__.c
            stamp = now()
            conn.execute(delete(ExportPlaceRow).where(places.owner == owner, places.lease_until < stamp))
            held = conn.execute(select(func.count()).select_from(ExportPlaceRow).where(places.owner == owner)).scalar()
            if held > limit:
                raise OverLimit(f"a merged export of this user's checkpoints is being made already (the limit is "
                                f"{limit} at a time, on every gateway); retry when it has finished", retry_after_s=30)
        return admit

    def check_checkpoint_bytes(self, caller: Caller) -> None:
        """Before a checkpoint made outside the queue (copy_weights): the user's checkpoints and
        snapshots on disk and what their queued saves reserve."""
        with self.db.engine.connect() as conn:
            used, largest, pending = self.db.stored_bytes(conn, caller.user_id)
        self._refuse_over_quota(used, largest * pending, pending)
