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
from sqlalchemy import and_, bindparam, delete, func, or_, select, text
from sqlalchemy.engine import Connection

from gateway.errors import OverLimit, error_response      # noqa: F401 - OverLimit: limits' refusals
from gateway.identity.caller import Caller
from gateway.settings import GatewaySettings
from gateway.storage.db import (CheckpointRow, Database, ExportPlaceRow, FutureRow, ModelRow, SamplingSessionRow,
                                 SessionRow, now)
from gateway.storage.prepared import Prepared
from tinkerd.errors import UserError


Admit = Callable[[Connection], None]     # raises to refuse (FutureStore.insert, Database.add_admitted)

# Requests that make a new training run, and those that write a checkpoint or snapshot to disk:
# pending ones are counted against the model cap and the checkpoint quota.
NEW_RUN_TYPES = ("create_model", "load_weights")
SAVE_TYPES = ("save_weights", "save_external_weights", "save_weights_for_sampler")

# The counts, prebuilt (parameters apart). Pending futures are counted so that they use
# ix_futures_pending: the literal `status = 'pending'` (a bound parameter would not match the
# partial index's condition).
_FUTURES = FutureRow.__table__.c
_MODELS = ModelRow.__table__.c
_SESSIONS = SessionRow.__table__.c
_SAMPLING = SamplingSessionRow.__table__.c
_CHECKPOINTS = CheckpointRow.__table__.c
_PENDING_OF = text("futures.status = 'pending'")
_COUNT = select(func.count()).select_from(FutureRow.__table__)
# Every request's admission counts: prepared (gateway/storage/prepared.py).
_PENDING_SAMPLES = Prepared(select(
    _COUNT.where(_PENDING_OF, _FUTURES.request_type == text("'sample'")).scalar_subquery(),
    _COUNT.where(_PENDING_OF, _FUTURES.request_type == text("'sample'"),
                 _FUTURES.owner == bindparam("owner")).scalar_subquery()))
_PENDING_TRAINING = Prepared(_COUNT.where(_PENDING_OF, _FUTURES.request_type != text("'sample'"),
                                          _FUTURES.owner == bindparam("owner")))
_PENDING_TRAINING_BYTES = Prepared(select(func.coalesce(func.sum(func.length(_FUTURES.request_body)), 0)).where(
    _PENDING_OF, _FUTURES.request_type != text("'sample'"), _FUTURES.owner == bindparam("owner")))
_OPEN_RUNS = select(func.count()).select_from(ModelRow.__table__.join(
    SessionRow.__table__, _SESSIONS.session_id == _MODELS.session_id)).where(
    _MODELS.owner == bindparam("owner"), _SESSIONS.finished.is_(False))
# Runs being created: their future is pending and the trainer has not made them yet (no row).
_RUNS_BEING_MADE = _COUNT.where(
    _PENDING_OF, _FUTURES.request_type.in_(NEW_RUN_TYPES),
    _FUTURES.owner == bindparam("owner"),
    ~select(_MODELS.model_id).where(_MODELS.model_id == _FUTURES.model_id).exists())
_PENDING_SAVES = _COUNT.where(_PENDING_OF, _FUTURES.request_type.in_(SAVE_TYPES),
                              _FUTURES.owner == bindparam("owner"))
# Ephemeral snapshots (save_weights_and_get_sampling_client): a sampling session of its own per
# snapshot, not made from a checkpoint's path.
_EPHEMERAL = and_(_SAMPLING.owner == bindparam("owner"), _SAMPLING.model_path.is_(None), _SAMPLING.snapshot_id != "")
_STORED_BYTES = select(
    select(func.coalesce(func.sum(_CHECKPOINTS.size_bytes), 0)).where(
        _CHECKPOINTS.owner == bindparam("owner")).scalar_subquery(),
    select(func.coalesce(func.sum(_SAMPLING.snapshot_bytes), 0)).where(_EPHEMERAL).scalar_subquery(),
    select(func.coalesce(func.max(_CHECKPOINTS.size_bytes), 0)).where(
        _CHECKPOINTS.owner == bindparam("owner")).scalar_subquery(),
    select(func.coalesce(func.max(_SAMPLING.snapshot_bytes), 0)).where(_EPHEMERAL).scalar_subquery())
_OPEN_SESSIONS = select(func.count()).select_from(SessionRow.__table__).where(
    _SESSIONS.owner == bindparam("owner"), _SESSIONS.finished.is_(False))
# Sampling sessions made by create_sampling_session (over the base model or a checkpoint's path)
# in open sessions; ephemeral ones are bounded by the checkpoint quota and pruned with their snapshot.
_OPEN_SAMPLING_SESSIONS = select(func.count()).select_from(SamplingSessionRow.__table__.join(
    SessionRow.__table__, _SESSIONS.session_id == _SAMPLING.session_id)).where(
    _SAMPLING.owner == bindparam("owner"), _SESSIONS.finished.is_(False),
    or_(_SAMPLING.snapshot_id == "", _SAMPLING.model_path.is_not(None)))
# The server-wide sample count's turn (samples_turn): a Postgres advisory lock, held to the commit.
_LOCK_SAMPLES = text("SELECT pg_advisory_xact_lock(:key)")
_SAMPLES_LOCK_KEY = 0x74696E6B73616D70     # "tinksamp"


def pending_training_in(conn: Connection, owner: str) -> int:
    """`owner`'s training futures pending on every gateway (queued or running)."""
    return _PENDING_TRAINING.first(conn, {"owner": owner})[0]


def pending_training_bytes_in(conn: Connection, owner: str) -> int:
    """The bytes of request `owner`'s pending training futures hold (stored, and queued in memory)."""
    return int(_PENDING_TRAINING_BYTES.first(conn, {"owner": owner})[0])


def pending_samples_in(conn: Connection, owner: str) -> tuple[int, int]:
    """(sample futures pending on every gateway, those of `owner`): one indexed query."""
    total, mine = _PENDING_SAMPLES.first(conn, {"owner": owner})
    return total, mine


def samples_turn(conn: Connection) -> None:
    """In an admitting transaction (Database.owner_turn): one sample admission at a time over all
    users, for the server-wide count. Postgres: an advisory lock to the commit, taken last
    (after the owner's), so no two transactions wait on each other. SQLite: the insert
    holds the write lock already."""
    if conn.dialect.name == "postgresql":
        conn.execute(_LOCK_SAMPLES, {"key": _SAMPLES_LOCK_KEY})


def runs_of(conn: Connection, owner: str) -> int:
    """`owner`'s training runs in open sessions, and those being made (create_model or
    load_weights pending, no row yet)."""
    return (conn.execute(_OPEN_RUNS, {"owner": owner}).scalar()
            + conn.execute(_RUNS_BEING_MADE, {"owner": owner}).scalar())


def run_exists(conn: Connection, model_id: str) -> bool:
    return conn.execute(select(_MODELS.model_id).where(_MODELS.model_id == model_id)).first() is not None


def stored_bytes(conn: Connection, owner: str) -> tuple[int, int, int]:
    """(bytes of `owner`'s checkpoints and ephemeral snapshots, the largest one of them (0:
    none yet), their saves pending)."""
    checkpoints, snapshots, largest_ckpt, largest_snapshot = conn.execute(_STORED_BYTES, {"owner": owner}).one()
    pending = conn.execute(_PENDING_SAVES, {"owner": owner}).scalar()
    return int(checkpoints) + int(snapshots), max(int(largest_ckpt), int(largest_snapshot)), pending


def open_sessions(conn: Connection, owner: str) -> int:
    return conn.execute(_OPEN_SESSIONS, {"owner": owner}).scalar()


def open_sampling_sessions(conn: Connection, owner: str) -> int:
    return conn.execute(_OPEN_SAMPLING_SESSIONS, {"owner": owner}).scalar()


async def on_over_limit(request: Request, exc: OverLimit):
    return error_response(str(exc), 429, headers={"Retry-After": str(exc.retry_after_s)})


class Limits:
    def __init__(self, settings: GatewaySettings, db: Database):
        self.settings = settings
        self.db = db

    def admit_training(self, caller: Caller, request_type: str, model_id: str | None) -> Admit:
        """What admits a training request's future (FutureStore.insert): the queue, and for a
        new run the model cap, for a save the checkpoint quota."""
        def admit(conn: Connection) -> None:
            # What only the user can free first (a 400 that says how), then what waiting frees (429).
            if request_type in NEW_RUN_TYPES and not run_exists(conn, model_id):
                self._admit_run(conn, caller)
            if request_type in SAVE_TYPES:
                self._admit_save(conn, caller)
            queued = pending_training_in(conn, caller.user_id) - 1
            if queued >= self.settings.max_queued_per_user:
                raise OverLimit(f"{queued} of your training requests are queued (limit "
                                f"{self.settings.max_queued_per_user}, --max-queued-per-user); retry when some "
                                f"finish")
            held = pending_training_bytes_in(conn, caller.user_id)
            if held > self.settings.max_queued_mib_per_user << 20:
                raise OverLimit(f"your queued training requests hold {held / 2**20:.1f} MiB (limit "
                                f"{self.settings.max_queued_mib_per_user} MiB, --max-queued-mib-per-user); retry "
                                f"when some finish")
        return admit

    def _admit_run(self, conn: Connection, caller: Caller) -> None:
        runs = runs_of(conn, caller.user_id) - 1
        if runs >= self.settings.max_models_per_user:
            raise UserError(f"you have {runs} training runs in open sessions or being created (limit "
                            f"{self.settings.max_models_per_user}, --max-models-per-user); close a ServiceClient "
                            f"to free them")

    def _admit_save(self, conn: Connection, caller: Caller) -> None:
        """The user's checkpoints and ephemeral snapshots on disk, plus what their other queued
        saves will write: each reserves the size of the user's largest save so far. While that
        is unknown (none finished yet) one save at a time is queued."""
        used, largest, pending = stored_bytes(conn, caller.user_id)
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
            sessions = open_sessions(conn, caller.user_id) - 1
            if sessions >= self.settings.max_sessions_per_user:
                raise UserError(f"you have {sessions} open sessions (limit {self.settings.max_sessions_per_user}, "
                                f"--max-sessions-per-user); close the ServiceClients you no longer use, or "
                                f"POST /api/v1/sessions/<session_id>/finish for those listed by GET /api/v1/sessions")
        return admit

    def admit_sampling_session(self, caller: Caller) -> Admit:
        def admit(conn: Connection) -> None:
            open_ = open_sampling_sessions(conn, caller.user_id) - 1
            if open_ >= self.settings.max_sampling_sessions_per_user:
                raise UserError(f"you have {open_} sampling sessions in open sessions (limit "
                                f"{self.settings.max_sampling_sessions_per_user}, --max-sampling-sessions-per-user); "
                                f"reuse a SamplingClient, or close its ServiceClient to free them")
        return admit

    def admit_sample(self, caller: Caller) -> Admit:
        """What admits a sample's future (FutureStore.insert): the server's samples in flight
        (--max-pending-samples, every user on every gateway), then the caller's. The server-wide
        count is taken one sample at a time (samples_turn), so a burst of several users
        cannot pass it either."""
        def admit(conn: Connection) -> None:
            samples_turn(conn)
            queued, pending = pending_samples_in(conn, caller.user_id)
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
            used, largest, pending = stored_bytes(conn, caller.user_id)
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
            used, largest, pending = stored_bytes(conn, caller.user_id)
        self._refuse_over_quota(used, largest * pending, pending)
