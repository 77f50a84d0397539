"""Plain GETs for external_weights files. The SDK's CLI downloads them without credentials, so
each URL carries its own expiry and signature (made by routes/checkpoints.py:external_urls)."""

from __future__ import annotations

import os

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse

from gateway import checkpoints
from gateway.db import CheckpointRow
from gateway.state import GatewayDep
from tinkerd.errors import NotFoundError

router = APIRouter()


@router.get("/files/{run_id}/external_weights/{name}/{relative:path}")
async def get_file(run_id: str, name: str, relative: str, request: Request, gw: GatewayDep) -> FileResponse:
    try:
        expires = int(request.query_params.get("expires", ""))
    except ValueError:
        expires = 0
    signed_path = checkpoints.download_path(run_id, f"external_weights/{name}", relative)
    if not gw.signer.url_valid(signed_path, expires, request.query_params.get("signature", "")):
        raise NotFoundError("this download link is unknown or has expired; ask for new external_weights_urls")
    row = gw.db.get(CheckpointRow, f"tinker://{run_id}/external_weights/{name}")
    if row is None:
        raise NotFoundError("unknown checkpoint")
    if "\x00" in relative:                     # os.path refuses it with a ValueError
        raise NotFoundError(f"no file {relative!r} in {row.tinker_path}")
    path = os.path.realpath(os.path.join(row.directory, relative))
    if not path.startswith(os.path.realpath(row.directory) + os.sep) or not os.path.isfile(path):
        raise NotFoundError(f"no file {relative!r} in {row.tinker_path}")
    return FileResponse(path)
