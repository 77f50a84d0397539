"""Signed download links of a checkpoint's files: the external weights' files (SDK 0.38's
get_external_weights_urls) and the whole checkpoint as one tar (the archive older SDKs download,
or `?format=merged`). Whoever holds a link may GET it, no key needed, while it lasts and while the
maker may still read the checkpoint (routes/files.py serves them and re-checks)."""

from __future__ import annotations

import asyncio
import datetime
import email.utils
import os
import time
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import RedirectResponse

from gateway import checkpoints, export, public_url
from gateway.identity import audit
from gateway.identity.auth import CallerDep
from gateway.identity.caller import Caller
from gateway.protocol import ExternalWeightsUrlsResponse
from gateway.state import Gateway, GatewayDep
from gateway.storage.db import CheckpointRow, aware
from tinkerd.errors import UserError

router = APIRouter(prefix="/api/v1")


# Download links for external weights last this long (or until the checkpoint expires).
URL_LIFETIME_S = 24 * 3600


@router.get(checkpoints.CHECKPOINT_ROUTE + "/external_weights_urls")
async def external_urls(run_id: str, checkpoint_id: str, request: Request, caller: CallerDep,
                        gw: GatewayDep) -> ExternalWeightsUrlsResponse:
    """Signed URLs: whoever holds one may download that file until it expires, no key needed."""
    row = await gw.sessions.checkpoint(caller, run_id, checkpoint_id, change=False)
    if row.checkpoint_type != "external":
        raise UserError(f"{row.tinker_path} is not an external_weights checkpoint")
    expires = _url_expiry(row)
    files = sorted(os.path.relpath(os.path.join(root, f), row.directory)
                   for root, _, names in os.walk(row.directory) for f in names)
    urls = {f: _signed_url(gw, request, caller, row, checkpoints.download_path(run_id, checkpoint_id, f), expires)
            for f in files}
    audit.read_by_other_user(gw.db, caller, row, "external_weights_urls")
    return ExternalWeightsUrlsResponse(urls=urls, expires=datetime.datetime.fromtimestamp(
        expires, datetime.timezone.utc).isoformat())


@router.get(checkpoints.CHECKPOINT_ROUTE + "/archive")
async def archive_url(run_id: str, checkpoint_id: str, request: Request, caller: CallerDep, gw: GatewayDep,
                      format: Annotated[Literal[export.FORMATS], Query()] = "peft") -> RedirectResponse:
    """SDKs up to 0.35 (RestClient.get_checkpoint_archive_url*, `tinker checkpoint download`): a
    302 to a signed URL of the checkpoint's files as one tar, with the link's expiry in `Expires`
    (the SDK reads the redirect without following it). `?format=merged`: the adapter merged into
    the base model instead (gateway/export.py), checked here so that what cannot be merged is a 400."""
    row = await gw.sessions.checkpoint(caller, run_id, checkpoint_id, change=False)
    if row.checkpoint_type not in ("training", "sampler"):
        raise UserError(f"{row.tinker_path} is an external_weights checkpoint: download its files with "
                        f"get_external_weights_urls")
    if format == "merged":        # reads the safetensors headers: off the loop
        await asyncio.to_thread(export.merged_plan, gw.settings.base_model, row)
    expires = _url_expiry(row)
    url = _signed_url(gw, request, caller, row, checkpoints.archive_path(run_id, checkpoint_id, format), expires)
    audit.read_by_other_user(gw.db, caller, row, "archive_url")
    return RedirectResponse(url, status_code=302, headers={"Expires": email.utils.formatdate(expires, usegmt=True)})


def _url_expiry(row: CheckpointRow) -> int:
    expires = int(time.time()) + URL_LIFETIME_S
    if row.expires_at is not None:
        expires = min(expires, int(aware(row.expires_at).timestamp()))
    return expires


def _signed_url(gw: Gateway, request: Request, caller: Caller, row: CheckpointRow, path: str, expires: int) -> str:
    """Whoever holds it may GET `path` until `expires`, no key needed, while the row and the
    caller's access to it last (routes/files.py re-checks both)."""
    base = public_url.base_url(request, gw.settings)
    grant = checkpoints.download_grant(row, path, expires, caller.user_id, caller.key_id)
    return f"{base}{path}?{gw.signer.url_query(grant)}"
