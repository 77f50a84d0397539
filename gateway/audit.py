"""The audit log: what happened to keys, sessions, runs and checkpoints, by whom, when.
Admins read a day of their organization's events (`GET /api/v1/audit`, the SDK's
`AdminClient.get_audit_log`). Event names are `<resource>_<action>`, as the SDK documents."""

from __future__ import annotations

import datetime

from sqlalchemy import select

from gateway.db import AuditRow, Database

# event -> the SDK's event_type filter it belongs to
EVENTS = {"api_key_created": "organizations", "api_key_revoked": "organizations",
          "session_created": "projects", "session_closed": "projects", "training_run_created": "projects",
          "checkpoint_saved": "checkpoints", "checkpoint_published": "checkpoints",
          "checkpoint_unpublished": "checkpoints", "checkpoint_ttl_set": "checkpoints",
          "checkpoint_deleted": "checkpoints", "checkpoint_expired": "checkpoints"}


def record(db: Database, event: str, *, user_id: str, org_id: str, **details) -> None:
    assert event in EVENTS, event
    db.add(AuditRow(event=event, user_id=user_id, org_id=org_id, details={"user_id": user_id, **details}))


def day_of(db: Database, org_id: str, day: datetime.date, event_type: str = "all") -> list[AuditRow]:
    """The organization's events from midnight to midnight UTC, oldest first."""
    start = datetime.datetime.combine(day, datetime.time(), tzinfo=datetime.timezone.utc)
    rows = db.select(select(AuditRow).where(AuditRow.org_id == org_id, AuditRow.at >= start,
                                            AuditRow.at < start + datetime.timedelta(days=1))
                     .order_by(AuditRow.event_id))
    return [r for r in rows if event_type == "all" or EVENTS.get(r.event) == event_type]
