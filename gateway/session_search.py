"""search_sessions (SDK 0.38): the sessions the caller may list that match every filter, newest
first, one page at a time.

Who may see what (gateway/projects.py): a user, the sessions in the projects they may list; an
admin, every session of their org. `owner` narrows it: their own (the default), anyone's they may
list (`accessible`), or named users'. A page ends where the next one starts (created_at, then
session_id, both descending: the sessions indexes), so paging costs the same at any depth. The
SDK's cursor is that position only; one from another query is refused when the session it names
would not be in this query's results by its fixed parts (owner, session id or display name,
user_metadata), so a status or project that changed since does not break a walk.
"""

from __future__ import annotations

import datetime

from sqlalchemy import and_, false, func, or_, select, tuple_

from gateway import projects
from gateway.identity.caller import Caller
from gateway.protocol import SessionSearchRequest, SessionSearchResponse, SessionSummary, StatusQuery
from gateway.storage.db import CheckpointRow, Database, ModelRow, SessionRow, UserRow, aware, now
from tinkerd.errors import UserError

OWNER_URN = "tml:organization_user:"


def search(db: Database, caller: Caller, body: SessionSearchRequest, active_within_s: float) -> SessionSearchResponse:
    fixed = [*_owner(db, caller, body), *_names(body), *_metadata(body)]
    conditions = [*fixed, *_visible(caller, body), *_in_projects(db, caller, body),
                  *_statuses(body.statuses, active_within_s)]
    if body.cursor is not None:
        at, last = body.cursor.last_created_at, body.cursor.last_session_id
        if not db.select(select(SessionRow.session_id).where(*fixed, SessionRow.session_id == last,
                                                             SessionRow.created_at == at)):
            raise UserError(f"cursor: session {last!r} at {at.isoformat()} is not a result of this query; pass "
                            f"the next_cursor of this same query's previous page, or none for the first page")
        # A row value: both databases seek the index to it (an OR of the two would walk from the top).
        conditions.append(tuple_(SessionRow.created_at, SessionRow.session_id) < tuple_(at, last))
    rows = db.select(select(SessionRow).where(*conditions).order_by(SessionRow.created_at.desc(),
                                                                  SessionRow.session_id.desc()).limit(body.limit + 1))
    page, more = rows[:body.limit], len(rows) > body.limit
    cursor = None
    if more:
        cursor = {"last_created_at": aware(page[-1].created_at).isoformat(), "last_session_id": page[-1].session_id}
    return SessionSearchResponse(sessions=summaries(db, page, active_within_s), next_cursor=cursor)


def _owner(db: Database, caller: Caller, body: SessionSearchRequest) -> list:
    if body.owner.type == "own":
        return [SessionRow.owner == caller.user_id]
    if body.owner.type == "accessible":
        return []
    ids = []
    for urn in body.owner.owner_urns:
        user_id = urn.removeprefix(OWNER_URN)
        user = db.get(UserRow, user_id) if urn.startswith(OWNER_URN) else None
        if user is None or user.org_id != caller.org_id:
            raise UserError(f"owner.owner_urns: {urn!r} is no user of this organization (owner URNs look like "
                            f"{OWNER_URN}<user id>, as SessionSummary.owner and TrainingRun.model_owner show)")
        ids.append(user_id)
    return [SessionRow.owner.in_(ids)]


def _like(word: str):
    escaped = word.lower().replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return func.lower(SessionRow.display_name).like(f"%{escaped}%", escape="\\")


def _names(body: SessionSearchRequest) -> list:
    """session_id and display_name: with both, a session matching either one matches."""
    either = []
    if body.session_id is not None:
        either.append(SessionRow.session_id == body.session_id)
    if body.display_name is not None:
        words = body.display_name.split()
        if not words:
            raise UserError("display_name: give at least one word to look for")
        either.append(and_(*[_like(w) for w in words]))
    return [or_(*either)] if either else []


def _metadata(body: SessionSearchRequest) -> list:
    for key in body.user_metadata:
        if '"' in key or "\\" in key:
            raise UserError(f"user_metadata: the key {key!r} holds a quote or backslash; search by another key")
    return [SessionRow.user_metadata[key].as_string() == value for key, value in body.user_metadata.items()]


def _visible(caller: Caller, body: SessionSearchRequest) -> list:
    if caller.admin:
        return [projects.in_org(caller)]
    if body.owner.type == "own":
        return []           # a user may list every project holding a session of theirs
    return [SessionRow.project_id.in_(select(projects.listable(caller)))]


def _in_projects(db: Database, caller: Caller, body: SessionSearchRequest) -> list:
    if body.project_ids is None:
        return []
    known = projects.Projects(db)
    for project_id in body.project_ids:
        if not known.may_list(caller, projects.checked_id(project_id, "project_ids:")):
            raise UserError(f"project_ids: {project_id!r} is not a project you may list (its members: who made it "
                            f"and who has a session in it; admins see all)")
    return [SessionRow.project_id.in_(body.project_ids)]


def _statuses(statuses: list[StatusQuery] | None, active_within_s: float) -> list:
    """Any of them. No session is ever failed or cancelled here (nothing fails or cancels a
    whole session), so those match none."""
    if statuses is None:
        return []
    lapsed = now() - datetime.timedelta(seconds=active_within_s)
    either = []
    for status in statuses:
        if status.type == "active":
            either.append(and_(SessionRow.finished.is_(False), SessionRow.last_heartbeat >= lapsed))
        elif status.type == "client_finished":
            reason = (SessionRow.finish_reason.in_(status.reasons) if status.reasons
                      else SessionRow.finish_reason.is_not(None))
            either.append(and_(SessionRow.finished.is_(True), reason))
        else:
            either.append(false())
    return [or_(*either)]


def status_of(row: SessionRow, active_within_s: float) -> dict | None:
    """SDK 0.38's SessionStatus: active while it heart-beats, client_finished with the reason its
    client gave; None when neither is known (heartbeats stopped, or closed without a reason)."""
    if row.finished:
        if row.finish_reason is None:
            return None
        return {"type": "client_finished", "reason": {"type": row.finish_reason}, "detail": row.finish_detail}
    if (now() - aware(row.last_heartbeat)).total_seconds() <= active_within_s:
        return {"type": "active"}
    return None


def summaries(db: Database, rows: list[SessionRow], active_within_s: float) -> list[SessionSummary]:
    ids = [r.session_id for r in rows]
    held: dict[str, tuple[int, int]] = {}
    if ids:
        with db.session() as s:
            for session_id, count, size in s.execute(
                    select(ModelRow.session_id, func.count(CheckpointRow.tinker_path),
                           func.coalesce(func.sum(CheckpointRow.size_bytes), 0))
                    .join(CheckpointRow, CheckpointRow.model_id == ModelRow.model_id)
                    .where(ModelRow.session_id.in_(ids)).group_by(ModelRow.session_id)):
                held[session_id] = (int(count), int(size))
    return [SessionSummary(session_id=r.session_id, created_at=aware(r.created_at).isoformat(),
                           owner=f"{OWNER_URN}{r.owner}", project_id=r.project_id or "",
                           status=status_of(r, active_within_s), checkpoints_count=held.get(r.session_id, (0, 0))[0],
                           checkpoint_storage_bytes=held.get(r.session_id, (0, 0))[1],
                           display_name=r.display_name, user_metadata=r.user_metadata or None)
            for r in rows]
