"""Projects: every session is in one, and its training runs, samplers and checkpoints with it.

A project is made when a user first names it (create_session's project_id, assign_session_project,
copy_weights' destination_project_id); a session that names none goes to its owner's default
project, `default-<user name>`, which only that user can make. Who may list a project, and so
see its sessions in search_sessions and its usage: the user who made it, every user with a
session in it, and the admins of its org. Putting a session into a project that exists needs the
same right (403 otherwise). Sessions are never taken out of a project, only moved to another.
"""

from __future__ import annotations

import re

from sqlalchemy import exists, select, union
from sqlalchemy.exc import IntegrityError

from gateway.identity import audit
from gateway.identity.caller import Caller
from gateway.storage.db import Database, ProjectRow, SessionRow, UserRow
from tinkerd.errors import UserError

DEFAULT_PREFIX = "default-"
_FORM = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:@+-]{0,127}$")


class Forbidden(UserError):
    """The caller may not use this project (HTTP 403)."""


def default_project(caller: Caller) -> str:
    return DEFAULT_PREFIX + caller.name


def checked_id(project_id: str, field: str = "project_id") -> str:
    if not isinstance(project_id, str) or not _FORM.match(project_id):
        raise UserError(f"{field} {project_id!r} is not a project id: 1-128 characters of letters, digits and "
                        f"_ . : @ + -, starting with a letter or digit")
    return project_id


def listable(caller: Caller):
    """The ids of the projects `caller` may list, as a subquery (a non-admin's: made by them, or
    holding a session of theirs); None for an admin (their org's projects: see in_org)."""
    if caller.admin:
        return None
    made = select(ProjectRow.project_id).where(ProjectRow.created_by == caller.user_id)
    holding = select(SessionRow.project_id).where(SessionRow.owner == caller.user_id,
                                                  SessionRow.project_id.is_not(None)).distinct()
    return union(made, holding).subquery()


def in_org(caller: Caller):
    """A condition on SessionRow: its owner is in the caller's org. Correlated (EXISTS, not IN), so
    a search walks the sessions newest first and checks each, instead of sorting the whole org's."""
    return exists().where(UserRow.user_id == SessionRow.owner, UserRow.org_id == caller.org_id)


class Projects:
    def __init__(self, db: Database):
        self.db = db

    def may_list(self, caller: Caller, project_id: str) -> bool:
        row = self.db.get(ProjectRow, project_id)
        if row is not None and (row.created_by == caller.user_id or (caller.admin and row.org_id == caller.org_id)):
            return True
        whose = in_org(caller) if caller.admin else SessionRow.owner == caller.user_id
        with self.db.session() as s:
            return bool(s.scalar(select(exists().where(SessionRow.project_id == project_id, whose))))

    def exists(self, project_id: str) -> bool:
        if self.db.get(ProjectRow, project_id) is not None:
            return True
        with self.db.session() as s:     # a default project from before projects had rows
            return bool(s.scalar(select(exists().where(SessionRow.project_id == project_id))))

    def place(self, caller: Caller, project_id: str | None) -> str:
        """The project a session of `caller` goes into: `project_id` (made if new) or their
        default one. A project of others that the caller may not list is Forbidden."""
        if project_id is None:
            project_id = default_project(caller)
        checked_id(project_id)
        if self.exists(project_id):
            if not self.may_list(caller, project_id):
                raise Forbidden(f"project {project_id!r} exists and you are not a member: its members (who made "
                                f"it, who has a session in it) or an admin can move a session of yours into it")
            return project_id
        if project_id.startswith(DEFAULT_PREFIX) and project_id != default_project(caller):
            raise UserError(f"project ids starting with {DEFAULT_PREFIX!r} are users' default projects; yours is "
                            f"{default_project(caller)!r}: name another project")
        if not self._make(caller, project_id) and not self.may_list(caller, project_id):
            raise Forbidden(f"project {project_id!r} was just made by another user; you are not a member")
        return project_id

    def _make(self, caller: Caller, project_id: str) -> bool:
        """The project's row, made by `caller`; False if one was made first (concurrently)."""
        try:
            self.db.add(ProjectRow(project_id=project_id, org_id=caller.org_id, created_by=caller.user_id))
        except IntegrityError:
            return False
        audit.record(self.db, "project_created", user_id=caller.user_id, org_id=caller.org_id, project_id=project_id)
        return True

    def move(self, session_id: str, project_id: str) -> None:
        """The session, and with it its runs, samplers and checkpoints (which name their session)."""
        self.db.touch(SessionRow, session_id, project_id=project_id)
