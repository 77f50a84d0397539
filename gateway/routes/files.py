"""Plain GETs for external_weights files and for checkpoint archives (SDKs up to 0.35). The SDK's
CLI downloads them without credentials, so each URL carries its own expiry and signature (made by
routes/checkpoints.py: external_urls, archive_url). The signature covers the checkpoint's row as it
was (its generation and owner) and who made the URL, and both are checked again here: a URL ends
when the checkpoint is deleted or saved again, when it is unpublished (for a URL made by another
user), or when the API key that made it is revoked. Every download is in the audit log."""

from __future__ import annotations

import os
import re

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, StreamingResponse

from gateway import checkpoints, export
from gateway.identity import audit
from gateway.identity.keys import Caller
from gateway.state import Gateway, GatewayDep
from gateway.storage.db import CheckpointRow
from tinkerd.errors import NotFoundError

router = APIRouter()
_KEY_ID = re.compile(r"^[0-9a-f]{16}$")
_REFUSED = "this download link is unknown, has expired or no longer grants access; ask for a new one"


def _authorized(request: Request, gw: Gateway, signed_path: str, row: CheckpointRow | None) -> Caller:
    """The user whose URL this is, if it is still good for `row`; else a 404 (one answer for every
    reason, so a link reveals nothing about the checkpoint)."""
    expires, signer = url_signer(request, gw)
    grant = row is not None and signer is not None and checkpoints.download_grant(
        row, signed_path, expires, signer.user_id, signer.key_id)
    if not grant or not signed_for(request, gw, grant):
        raise NotFoundError(_REFUSED)
    return signer


def url_signer(request: Request, gw: Gateway) -> tuple[int, Caller | None]:
    """(expiry, the user whose API key made the URL, if that key is still valid) of a signed URL."""
    query = request.query_params
    try:
        expires = int(query.get("expires", ""))
    except ValueError:
        expires = 0
    signer_key_id = query.get("by", "")
    if signer_key_id:
        signer = gw.authenticator.keys.caller_for_key_id(signer_key_id) if _KEY_ID.match(signer_key_id) else None
    else:
        signer = gw.authenticator.anonymous          # made with --no-auth
    return expires, signer


def signed_for(request: Request, gw: Gateway, grant) -> bool:
    """Whether the URL's signature is good for `grant` (rebuilt from the state now)."""
    return gw.signer.url_valid(grant, request.query_params.get("kid", ""), request.query_params.get("signature", ""))


def _downloaded(gw: Gateway, signer: Caller, row: CheckpointRow, what: str) -> None:
    audit.checkpoint_access(gw.db, "checkpoint_downloaded", row, user_id=signer.user_id, org_id=signer.org_id,
                            file=what)


@router.get("/files/{run_id}/external_weights/{name}/{relative:path}")
async def get_file(run_id: str, name: str, relative: str, request: Request, gw: GatewayDep) -> FileResponse:
    row = gw.db.get(CheckpointRow, f"tinker://{run_id}/external_weights/{name}")
    signer = _authorized(request, gw, checkpoints.download_path(run_id, f"external_weights/{name}", relative), row)
    if "\x00" in relative:                     # os.path refuses it with a ValueError
        raise NotFoundError(f"no file {relative!r} in {row.tinker_path}")
    path = os.path.realpath(os.path.join(row.directory, relative))
    if not path.startswith(os.path.realpath(row.directory) + os.sep) or not os.path.isfile(path):
        raise NotFoundError(f"no file {relative!r} in {row.tinker_path}")
    _downloaded(gw, signer, row, relative)
    return FileResponse(path)


def _archived(request: Request, gw, run_id: str, kind: str, name: str, format: str) -> CheckpointRow:
    if kind not in ("weights", "sampler_weights"):
        raise NotFoundError(f"no archive of {kind} checkpoints")
    row = gw.db.get(CheckpointRow, checkpoints.tinker_path(run_id, kind, name))
    signer = _authorized(request, gw, checkpoints.archive_path(run_id, f"{kind}/{name}", format), row)
    if not os.path.isdir(row.directory):
        raise NotFoundError("the checkpoint's files are gone (deleted since the link was made?)")
    _downloaded(gw, signer, row, "merged.tar" if format == "merged" else "archive.tar")
    return row


def _tar_response(size: int, chunks, filename: str) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="application/x-tar", headers={
        "Content-Length": str(size), "Content-Disposition": f'attachment; filename="{filename}"'})


@router.get("/files/{run_id}/{kind}/{name}/archive.tar")
async def get_archive(run_id: str, kind: str, name: str, request: Request, gw: GatewayDep) -> StreamingResponse:
    # Registered after get_file: an external_weights file named archive.tar is that file.
    row = _archived(request, gw, run_id, kind, name, "peft")
    size, chunks = export.peft_archive(row)
    return _tar_response(size, chunks, f"{name}.tar")


@router.get("/files/{run_id}/{kind}/{name}/merged.tar")
async def get_merged_archive(run_id: str, kind: str, name: str, request: Request,
                             gw: GatewayDep) -> StreamingResponse:
    """The adapter merged into the base model (gateway/export.py); made as it is sent, in
    starlette's thread pool (a sync iterator), off the event loop."""
    row = _archived(request, gw, run_id, kind, name, "merged")
    size, chunks = export.merged_archive(gw.settings.base_model, row)
    return _tar_response(size, chunks, f"{name}-merged.tar")
