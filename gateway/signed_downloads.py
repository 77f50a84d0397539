"""Downloads by signed URL, the parts every such route shares: who signed a URL (and whether the
grant still holds), the audit of a download, and byte ranges and HEAD as object stores answer them
(gateway/routes/files.py: checkpoint files and archives; gateway/routes/traces.py: session traces)."""

from __future__ import annotations

import re
import typing
from typing import Callable, Iterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from gateway import checkpoints
from gateway.errors import error_response
from gateway.identity import audit
from gateway.identity.caller import Caller
from gateway.storage.db import CheckpointRow
from tinkerd.errors import NotFoundError

if typing.TYPE_CHECKING:           # the container the routes hand over (gateway/state.py)
    from gateway.state import Gateway

_KEY_ID = re.compile(r"^[0-9a-f]{16}$")
_REFUSED = "this download link is unknown, has expired or no longer grants access; ask for a new one"
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$", re.IGNORECASE)
GET_HEAD = ["GET", "HEAD"]


def authorized(request: Request, gw: Gateway, signed_path: str, row: CheckpointRow | None) -> Caller:
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


def downloaded(gw: Gateway, signer: Caller, row: CheckpointRow, what: str) -> None:
    audit.checkpoint_access(gw.db, "checkpoint_downloaded", row, user_id=signer.user_id, org_id=signer.org_id,
                            file=what)


class RangeError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def byte_range(request: Request, size: int) -> tuple[int, int] | None:
    """The [start, end) a GET's Range header asks of `size` bytes, or None for all of them (RFC
    9110). One range of bytes is served; several, or a malformed one, is a 400 that says so; one
    that starts past the end is a 416. A unit other than bytes is ignored, as is a Range under an
    If-Range: that asks for the range only if the file is the one it names, and these files carry
    no validator to match, so the whole file is sent."""
    header = request.headers.get("range")
    spec = "".join((header or "").split())
    if header is None or "if-range" in request.headers or not spec.lower().startswith("bytes="):
        return None
    match = _RANGE.match(spec)
    if not match or match.groups() == ("", ""):
        raise RangeError(400, f"Range {header!r} is not served: ask for one range of bytes, "
                              f"'bytes=FIRST-LAST', 'bytes=FIRST-' or 'bytes=-SUFFIX_LENGTH'")
    first, last = match.groups()
    if not first:                                    # 'bytes=-N': the last N bytes
        if int(last) == 0:
            raise RangeError(416, f"Range {header!r} asks for no bytes of the {size}")
        start, end = max(size - int(last), 0), size
    elif last and int(last) < int(first):
        raise RangeError(400, f"Range {header!r} ends before it starts")
    else:
        start, end = int(first), min(int(last) + 1, size) if last else size
    if start >= size:
        raise RangeError(416, f"Range {header!r} starts past the end: the file is {size} bytes")
    return start, end


def ranged(request: Request, size: int, chunks: Callable[[int, int], Iterator[bytes]], headers: dict,
           media_type: str) -> Response:
    """The answer to a GET or HEAD of a file of `size` bytes whose bytes [start, end) `chunks`
    makes: all of it (200) or the Range asked for (206), with no body for a HEAD."""
    try:
        span = byte_range(request, size)
    except RangeError as e:
        extra = {"Content-Range": f"bytes */{size}"} if e.status == 416 else None
        return error_response(str(e), e.status, extra)
    start, end = span or (0, size)
    headers = {**headers, "Accept-Ranges": "bytes", "Content-Length": str(end - start)}
    if span is not None:
        headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
    status = 200 if span is None else 206
    if request.method == "HEAD":
        return Response(status_code=status, headers=headers, media_type=media_type)
    return StreamingResponse(chunks(start, end), status_code=status, headers=headers, media_type=media_type)


def byte_response(request: Request, body: bytes, headers: dict, media_type: str) -> Response:
    """`ranged` for bytes in memory."""
    return ranged(request, len(body), lambda start, end: iter((body[start:end],)), headers, media_type)
