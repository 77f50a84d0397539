"""Usage for chargeback, as SDK 0.38's AdminClient reads it: hourly usage events and the current
checkpoint storage (gateway/billing.py makes them from what gateway/usage.py counted)."""

from __future__ import annotations

import asyncio
import datetime
from typing import Annotated

from fastapi import APIRouter, Query

from gateway import billing
from gateway.identity.auth import CallerDep
from gateway.projects import Projects, checked_id
from gateway.protocol import StorageQuery, UsageWindow
from gateway.state import GatewayDep
from tinkerd.errors import UserError

router = APIRouter(prefix="/api/v1")


@router.get("/billing/usage/events")
async def usage_events(query: Annotated[UsageWindow, Query()], caller: CallerDep, gw: GatewayDep) -> dict:
    """Admins: every user of their org; others: their own usage."""
    billing.check_window(query.starting_on, query.ending_before)
    utc = datetime.timezone.utc
    return await asyncio.to_thread(billing.usage_events, gw.db, gw.settings, caller,
                                   query.starting_on.astimezone(utc), query.ending_before.astimezone(utc))


@router.get("/billing/usage/checkpoints/current")
async def current_checkpoint_storage(query: Annotated[StorageQuery, Query()], caller: CallerDep,
                                     gw: GatewayDep) -> dict:
    if query.project_id is not None and not await asyncio.to_thread(
            Projects(gw.db).may_list, caller, checked_id(query.project_id)):
        raise UserError(f"project_id {query.project_id!r} is not a project you may list")
    return await asyncio.to_thread(billing.current_storage, gw.db, gw.settings, caller, query.project_id)
