"""Plain GETs for external_weights files (the SDK's CLI downloads them without auth headers)."""

from __future__ import annotations

import os

from fastapi import APIRouter
from fastapi.responses import FileResponse

from gateway.db import CheckpointRow
from gateway.state import GatewayDep
from tinkerd.errors import NotFoundError

router = APIRouter()


@router.get("/files/{run_id}/external_weights/{name}/{relative:path}")
async def get_file(run_id: str, name: str, relative: str, gw: GatewayDep) -> FileResponse:
    row = gw.db.get(CheckpointRow, f"tinker://{run_id}/external_weights/{name}")
    if row is None:
        raise NotFoundError("unknown checkpoint")
    if "\x00" in relative:                     # os.path refuses it with a ValueError
        raise NotFoundError(f"no file {relative!r} in {row.tinker_path}")
    path = os.path.realpath(os.path.join(row.directory, relative))
    if not path.startswith(os.path.realpath(row.directory) + os.sep) or not os.path.isfile(path):
        raise NotFoundError(f"no file {relative!r} in {row.tinker_path}")
    return FileResponse(path)
