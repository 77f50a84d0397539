"""Plain GETs for external_weights files and for checkpoint archives (SDKs up to 0.35). The SDK's
CLI downloads them without credentials, so each URL carries its own expiry and signature (made by
routes/checkpoints.py: external_urls, archive_url). The signature covers the checkpoint's row as it
was (its generation and owner) and who made the URL, and both are checked again here: a URL ends
when the checkpoint is deleted or saved again, when it is unpublished (for a URL made by another
user), or when the API key that made it is revoked. Every download is in the audit log.

Like an object store's URLs, each answers HEAD (the GET's headers, Content-Length included, and
no body) and a ranged GET (`Range: bytes=a-b`, one range: 206 with Content-Range, 416 where it
starts past the end), so a client can check a download's size, resume it, or fetch it in parts.
An archive is made as it is sent, and a range starts making it where the range starts."""

from __future__ import annotations

import asyncio
import os
from typing import Callable, Iterator

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, Response, StreamingResponse

from gateway import checkpoints, export
from gateway.signed_downloads import GET_HEAD, authorized, downloaded, ranged
from gateway.state import GatewayDep
from gateway.storage.db import CheckpointRow
from tinkerd.errors import NotFoundError

router = APIRouter()
@router.api_route("/files/{run_id}/external_weights/{name}/{relative:path}", methods=GET_HEAD)
async def get_file(run_id: str, name: str, relative: str, request: Request, gw: GatewayDep) -> FileResponse:
    """One file, sent by starlette's FileResponse, which answers HEAD and Range itself."""
    # The checks read the database (the URL's signer, perhaps a made-up one) and write the audit log.
    return await asyncio.to_thread(_file, run_id, name, relative, request, gw)


def _file(run_id: str, name: str, relative: str, request: Request, gw) -> FileResponse:
    row = gw.db.get(CheckpointRow, f"tinker://{run_id}/external_weights/{name}")
    signer = authorized(request, gw, checkpoints.download_path(run_id, f"external_weights/{name}", relative), row)
    if "\x00" in relative:                     # os.path refuses it with a ValueError
        raise NotFoundError(f"no file {relative!r} in {row.tinker_path}")
    path = os.path.realpath(os.path.join(row.directory, relative))
    if not path.startswith(os.path.realpath(row.directory) + os.sep) or not os.path.isfile(path):
        raise NotFoundError(f"no file {relative!r} in {row.tinker_path}")
    if request.method == "GET":
        downloaded(gw, signer, row, relative)
    return FileResponse(path)


def _archived(request: Request, gw, run_id: str, kind: str, name: str, format: str) -> CheckpointRow:
    """The checkpoint a signed archive URL is good for (blocking: the database, so in a thread)."""
    if kind not in ("weights", "sampler_weights"):
        raise NotFoundError(f"no archive of {kind} checkpoints")
    row = gw.db.get(CheckpointRow, checkpoints.tinker_path(run_id, kind, name))
    signer = authorized(request, gw, checkpoints.archive_path(run_id, f"{kind}/{name}", format), row)
    if not os.path.isdir(row.directory):
        raise NotFoundError("the checkpoint's files are gone (deleted since the link was made?)")
    if request.method == "GET":              # a HEAD downloads nothing
        downloaded(gw, signer, row, "merged.tar" if format == "merged" else "archive.tar")
    return row


def _tar_response(request: Request, archive: checkpoints.Tar, filename: str,
                  stream: Callable[[Iterator[bytes]], Iterator[bytes]] = iter) -> Response:
    return ranged(request, archive.size, lambda start, end: stream(archive.chunks(start, end)),
                  {"Content-Disposition": f'attachment; filename="{filename}"'}, "application/x-tar")


@router.api_route("/files/{run_id}/{kind}/{name}/archive.tar", methods=GET_HEAD)
async def get_archive(run_id: str, kind: str, name: str, request: Request, gw: GatewayDep) -> Response:
    # Registered after get_file: an external_weights file named archive.tar is that file.
    row = await asyncio.to_thread(_archived, request, gw, run_id, kind, name, "peft")
    return _tar_response(request, export.peft_archive(row), f"{name}.tar")


@router.api_route("/files/{run_id}/{kind}/{name}/merged.tar", methods=GET_HEAD)
async def get_merged_archive(run_id: str, kind: str, name: str, request: Request, gw: GatewayDep) -> Response:
    """The adapter merged into the base model (gateway/export.py); made as it is sent, in
    starlette's thread pool (a sync iterator), off the event loop. A HEAD merges nothing."""
    row = await asyncio.to_thread(_archived, request, gw, run_id, kind, name, "merged")
    archive = await asyncio.to_thread(export.merged_archive, gw.settings.base_model, row)   # reads headers
    if request.method == "HEAD":
        return _tar_response(request, archive, f"{name}-merged.tar")
    place = await asyncio.to_thread(export.take_place, gw.limits, row.owner)    # counted in the database
    response = _tar_response(request, archive, f"{name}-merged.tar", place.stream)
    if not isinstance(response, StreamingResponse):          # a refused range: nothing is made
        await asyncio.to_thread(place.release)
    return response
