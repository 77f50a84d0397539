"""Plain GETs for external_weights files and for checkpoint archives (SDKs up to 0.35). The SDK's
CLI downloads them without credentials, so each URL carries its own expiry and signature (made by
routes/checkpoints.py: external_urls, archive_url)."""

from __future__ import annotations

import os

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, StreamingResponse

from gateway import checkpoints, export
from gateway.db import CheckpointRow
from gateway.state import GatewayDep
from tinkerd.errors import NotFoundError

router = APIRouter()


def _check_signature(request: Request, gw, signed_path: str) -> None:
    try:
        expires = int(request.query_params.get("expires", ""))
    except ValueError:
        expires = 0
    if not gw.signer.url_valid(signed_path, expires, request.query_params.get("signature", "")):
        raise NotFoundError("this download link is unknown or has expired; ask for a new one")


@router.get("/files/{run_id}/external_weights/{name}/{relative:path}")
async def get_file(run_id: str, name: str, relative: str, request: Request, gw: GatewayDep) -> FileResponse:
    _check_signature(request, gw, checkpoints.download_path(run_id, f"external_weights/{name}", relative))
    row = gw.db.get(CheckpointRow, f"tinker://{run_id}/external_weights/{name}")
    if row is None:
        raise NotFoundError("unknown checkpoint")
    if "\x00" in relative:                     # os.path refuses it with a ValueError
        raise NotFoundError(f"no file {relative!r} in {row.tinker_path}")
    path = os.path.realpath(os.path.join(row.directory, relative))
    if not path.startswith(os.path.realpath(row.directory) + os.sep) or not os.path.isfile(path):
        raise NotFoundError(f"no file {relative!r} in {row.tinker_path}")
    return FileResponse(path)


def _archived(request: Request, gw, run_id: str, kind: str, name: str, format: str) -> CheckpointRow:
    if kind not in ("weights", "sampler_weights"):
        raise NotFoundError(f"no archive of {kind} checkpoints")
    _check_signature(request, gw, checkpoints.archive_path(run_id, f"{kind}/{name}", format))
    row = gw.db.get(CheckpointRow, checkpoints.tinker_path(run_id, kind, name))
    if row is None or not os.path.isdir(row.directory):
        raise NotFoundError("unknown checkpoint (deleted since the link was made?)")
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
