"""The audit log: what happened to keys, sessions, runs and checkpoints, by whom, when.
Admins read a day of their organization's events (`GET /api/v1/audit`, the SDK's
`AdminClient.get_audit_log`). Event names are `<resource>_<action>`, as the SDK documents.

Reads of a checkpoint by a user who does not own it (a published one: sampled from, loaded,
copied, its weights_info, download links made) and every download through a signed URL are
recorded too, in the reader's organization and, if it differs, the owner's."""

from __future__ import annotations

import datetime

from sqlalchemy import select

from gateway.storage.db import AuditRow, CheckpointRow, Database, UserRow

# event -> the SDK's event_type filter it belongs to
EVENTS = {"api_key_created": "organizations", "api_key_revoked": "organizations",
          "session_created": "projects", "session_closed": "projects", "training_run_created": "projects",
          "project_created": "projects", "session_project_assigned": "projects",
          "checkpoint_saved": "checkpoints", "checkpoint_published": "checkpoints",
          "checkpoint_unpublished": "checkpoints", "checkpoint_ttl_set": "checkpoints",
          "checkpoint_deleted": "checkpoints", "checkpoint_expired": "checkpoints",
          "checkpoint_read_by_other_user": "checkpoints", "checkpoint_downloaded": "checkpoints",
          "checkpoint_access_token_created": "checkpoints", "checkpoint_access_token_revoked": "checkpoints"}


def entry(event: str, *, user_id: str, org_id: str, **details) -> AuditRow:
    """An event's row, for a transaction that writes what it records."""
    assert event in EVENTS, event
    return AuditRow(event=event, user_id=user_id, org_id=org_id, details={"user_id": user_id, **details})


def record(db: Database, event: str, *, user_id: str, org_id: str, **details) -> None:
    db.add(entry(event, user_id=user_id, org_id=org_id, **details))


def checkpoint_access(db: Database, event: str, row: CheckpointRow, *, user_id: str, org_id: str,
                      **details) -> None:
    """`event` on another user's (or one's own) checkpoint `row`: in the reader's organization's
    log, and in the owner's where that is another organization."""
    fields = {"model_id": row.model_id, "tinker_path": row.tinker_path, "owner": row.owner or "", **details}
    record(db, event, user_id=user_id, org_id=org_id, **fields)
    owner = db.get(UserRow, row.owner) if row.owner else None
    if owner is not None and owner.org_id != org_id:
        record(db, event, user_id=user_id, org_id=owner.org_id, **fields)


def read_by_other_user(db: Database, caller, row: CheckpointRow, via: str) -> None:
    """Records a read of `row` by `caller` (gateway.identity.keys.Caller) if it is not theirs."""
    if row.owner != caller.user_id:
        checkpoint_access(db, "checkpoint_read_by_other_user", row, user_id=caller.user_id,
                          org_id=caller.org_id, via=via)


def day_of(db: Database, org_id: str, day: datetime.date, event_type: str = "all") -> list[AuditRow]:
    """The organization's events from midnight to midnight UTC, oldest first."""
    start = datetime.datetime.combine(day, datetime.time(), tzinfo=datetime.timezone.utc)
    rows = db.select(select(AuditRow).where(AuditRow.org_id == org_id, AuditRow.at >= start,
                                            AuditRow.at < start + datetime.timedelta(days=1))
                     .order_by(AuditRow.event_id))
    return [r for r in rows if event_type == "all" or EVENTS.get(r.event) == event_type]
