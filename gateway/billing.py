"""The usage reports of SDK 0.38's AdminClient (`tinker billing usage`, `tinker billing
checkpoint-storage`), from what gateway/usage.py counted.

An admin sees every user of their org, anyone else their own usage. Costs are estimates from the
unit prices the gateway was given (--price-*); without a price, a cost and its rate are null, never
invented. There are no invoices here, so `cost_data_through` is null. Storage is in decimal GB
(10^9 bytes); a GB-month is 720 GB-hours, as the SDK documents.
"""

from __future__ import annotations

import collections
import datetime

from sqlalchemy import or_, select

from gateway.identity.caller import Caller
from gateway.settings import GatewaySettings
from gateway.storage.db import CheckpointStorageRow, Database, SessionRow, UsageRow, UserRow, aware, now
from tinkerd.errors import UserError

MAX_WINDOW = datetime.timedelta(days=14)
HOUR = datetime.timedelta(hours=1)
GB = 1e9
HOURS_PER_MONTH = 720
OWNER_URN = "tml:organization_user:"


def check_window(starting_on: datetime.datetime, ending_before: datetime.datetime) -> None:
    """A window the SDK documents: UTC hours, at most 14 days, starting no later than now."""
    for name, t in (("starting_on", starting_on), ("ending_before", ending_before)):
        if t.tzinfo is None:
            raise UserError(f"{name} {t.isoformat()} has no time zone: give a UTC time such as 2026-07-13T00:00:00Z")
        if (t.minute, t.second, t.microsecond) != (0, 0, 0) or t.utcoffset().total_seconds() % 3600:
            raise UserError(f"{name} {t.isoformat()} is not on a UTC hour boundary (minutes, seconds and "
                            f"fractions must be 0)")
    if ending_before <= starting_on:
        raise UserError(f"ending_before {ending_before.isoformat()} must be after starting_on {starting_on.isoformat()}")
    if ending_before - starting_on > MAX_WINDOW:
        raise UserError(f"the window from starting_on to ending_before is {ending_before - starting_on}; at most 14 "
                        f"days: ask for it in parts")
    if starting_on > now():
        raise UserError(f"starting_on {starting_on.isoformat()} is in the future")


def token_rate(settings: GatewaySettings, kind: str, cached: bool) -> float | None:
    """USD per million tokens of `kind`, or None where no price was given."""
    if kind == "training":
        return settings.price_training_per_mtok
    if kind == "sampling_prefill" and not cached:        # (cached prefill is not counted apart yet)
        return settings.price_prefill_per_mtok
    if kind == "sampling_sample":
        return settings.price_sampled_per_mtok
    return None


def _owners(caller: Caller):
    """A condition on an `owner` column: whose usage the caller may see."""
    if caller.admin:
        return select(UserRow.user_id).where(UserRow.org_id == caller.org_id)
    return [caller.user_id]


def _storage_hours(db: Database, caller: Caller, start: datetime.datetime,
                   end: datetime.datetime) -> dict[tuple, float]:
    """GB-hours per (hour, owner, session, base model) of the checkpoints stored in the window."""
    stop = min(end, now())
    s = CheckpointStorageRow
    rows = db.select(select(s).where(s.owner.in_(_owners(caller)), s.since < stop,
                                     or_(s.until.is_(None), s.until > start)))
    out: dict[tuple, float] = collections.defaultdict(float)
    for row in rows:
        first, last = max(aware(row.since), start), min(aware(row.until) if row.until else stop, stop)
        hour = first.replace(minute=0, second=0, microsecond=0)
        while hour < last:
            seconds = (min(hour + HOUR, last) - max(hour, first)).total_seconds()
            if seconds > 0:
                out[hour, row.owner, row.session_id, row.base_model] += row.size_bytes / GB * seconds / 3600
            hour += HOUR
    return out


def _envelope(bucket: datetime.datetime, owner: str, session_id: str, base_model: str, project_id: str | None,
              users: dict[str, UserRow]) -> dict:
    user = users.get(owner)
    return {"bucket_start": bucket.isoformat(), "bucket_end": (bucket + HOUR).isoformat(), "base_model": base_model,
            "user_id": f"{OWNER_URN}{owner}", "user_name": user.name if user else None,
            "session_id": session_id or None, "project_id": project_id, "estimated_cost_usd": None,
            "effective_rate_usd_per_million_tokens": None, "effective_rate_usd_per_gigabyte_month": None}


def _token_event(row: UsageRow, settings: GatewaySettings, users: dict) -> tuple[dict, int]:
    event = _envelope(aware(row.bucket_start), row.owner, row.session_id, row.base_model, row.project_id, users)
    if row.kind == "checkpoint":
        event["event_info"] = {"type": "checkpoint", "count": row.quantity}
        return event, row.quantity
    info = {"type": row.kind, "token_count": row.quantity}
    if row.kind == "sampling_prefill":
        info["cached"] = bool(row.cached)
    rate = token_rate(settings, row.kind, bool(row.cached))
    event.update(event_info=info, effective_rate_usd_per_million_tokens=rate,
                 estimated_cost_usd=None if rate is None else rate * row.quantity / 1e6)
    return event, row.quantity


def usage_events(db: Database, settings: GatewaySettings, caller: Caller, start: datetime.datetime,
                 end: datetime.datetime) -> dict:
    """BillingUsageResponse: every hourly bucket in [start, end), by bucket then largest first."""
    rows = db.select(select(UsageRow).where(UsageRow.bucket_start >= start, UsageRow.bucket_start < end,
                                            UsageRow.owner.in_(_owners(caller))))
    storage = _storage_hours(db, caller, start, end)
    sessions = {sid: db.get(SessionRow, sid) for sid in {r.session_id for r in rows} | {k[2] for k in storage} if sid}
    users = {u.user_id: u for u in db.select(select(UserRow).where(
        UserRow.user_id.in_({r.owner for r in rows} | {k[1] for k in storage})))}
    events = [_token_event(r, settings, users) for r in rows]
    rate = settings.price_storage_per_gb_month
    for (hour, owner, session_id, base_model), gb_hours in storage.items():
        session = sessions.get(session_id)
        event = _envelope(hour, owner, session_id, base_model, session.project_id if session else None, users)
        event.update(event_info={"type": "storage", "free": False, "gigabyte_hours": gb_hours},
                     effective_rate_usd_per_gigabyte_month=rate,
                     estimated_cost_usd=None if rate is None else rate * gb_hours / HOURS_PER_MONTH)
        events.append((event, gb_hours))
    events.sort(key=lambda e: (e[0]["bucket_start"], -e[1]))
    return {"data": [e for e, _ in events], "cost_data_through": None,
            "sessions": {sid: {"user_metadata": s.user_metadata or None} for sid, s in sessions.items() if s}}


def current_storage(db: Database, settings: GatewaySettings, caller: Caller, project_id: str | None) -> dict:
    """CurrentCheckpointStorageUsageResponse: the checkpoints stored now, by project and owner."""
    s = CheckpointStorageRow
    rows = db.select(select(s).where(s.until.is_(None), s.owner.in_(_owners(caller))))
    projects = {sid: (row.project_id if row else None) for sid, row in
                ((sid, db.get(SessionRow, sid)) for sid in {r.session_id for r in rows})}
    groups: dict[tuple, list[int]] = collections.defaultdict(lambda: [0, 0])
    for row in rows:
        project = projects.get(row.session_id)
        if project_id is None or project == project_id:
            group = groups[project, row.owner]
            group[0] += 1
            group[1] += row.size_bytes
    users = {u.user_id: u for u in db.select(select(UserRow).where(UserRow.user_id.in_({k[1] for k in groups})))}
    rate = settings.price_storage_per_gb_month
    return {"effective_rate_usd_per_gigabyte_month": rate, "data": [
        {"project_id": project, "org_user_urn": f"{OWNER_URN}{owner}",
         "user_email": users[owner].email or None if owner in users else None,
         "user_name": users[owner].name if owner in users else None, "checkpoint_count": n, "size_bytes": size,
         "size_gigabytes": size / GB,
         "estimated_monthly_cost_usd": None if rate is None else rate * size / GB}
        for (project, owner), (n, size) in sorted(groups.items(), key=lambda kv: (kv[0][0] or "", kv[0][1]))]}
