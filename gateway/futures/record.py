"""A future's row as a gateway makes it in memory (gateway/futures/store.py): a new one, a finished
one kept among its recent results or read back from the database, a pending one's answer to a
long-poll. Its fields are
FutureRow's columns (gateway/storage/db.py), read by the same names, so either serves wherever a
row is read; the futures' hot path makes no ORM object (whose instrumented attributes cost more
to make and read than the rest of the row's handling)."""

from __future__ import annotations

import dataclasses
import datetime

from gateway.storage.db import Status


@dataclasses.dataclass(slots=True)
class FutureRecord:
    """FutureRow's columns, as plain fields."""
    request_id: str
    idempotency_key: str | None = None
    fingerprint: str | None = None
    owner: str | None = None
    request_type: str = ""
    model_id: str | None = None
    status: str = Status.PENDING
    content_type: str | None = None
    result: bytes | None = None
    extra: dict | None = None
    created_at: datetime.datetime | None = None
    completed_at: datetime.datetime | None = None
    request_args: dict | None = None
    request_body: bytes | None = None
    claimed_by: str | None = None
    lease_until: datetime.datetime | None = None
