"""Request bodies bounded before any route sees them, by the gateway's one middleware
(gateway/edge.py).

A body over `max_bytes` is a 413 with the Tinker error body: at once when Content-Length says so,
else as soon as the bytes read pass the limit. A zstd body (the SDK compresses forward_backward)
is inflated here, never past the same limit, and handed on plain, without Content-Encoding.
Routes whose bodies are small by nature have a smaller limit (ROUTE_LIMITS).
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive

from gateway import convert
from gateway.errors import error_response
from tinkerd import custom_loss
from tinkerd.errors import UserError

# Every route's body is as large as its nature needs, never over --max-body-bytes: JSON costs the
# event loop ~0.1 ms per KiB to parse and validate, so only the routes that read theirs off the
# loop (gateway/bodies.py) take large JSON; the rest take SMALL_BYTES.
SMALL_BYTES = 256 << 10
LARGE_JSON_BYTES = 8 << 20          # a prompt of a long context, 65,536 acknowledged ids
ROUTE_LIMITS = {
    "/api/v1/forward_backward": None,           # protobuf, its cost bounded from shapes (convert.check_cost)
    # A graph is at most custom_loss.MAX_GRAPH_BYTES: a larger body is not worth inflating or parsing.
    "/api/v1/create_custom_loss": custom_loss.MAX_REQUEST_BYTES,
    "/api/v1/asample": LARGE_JSON_BYTES,
    "/api/v1/retrieve_futures": LARGE_JSON_BYTES,
    "/oai/api/v1/chat/completions": LARGE_JSON_BYTES,
    "/oai/api/v1/completions": LARGE_JSON_BYTES,
    "/api/v1/telemetry": LARGE_JSON_BYTES,      # not parsed
    "/api/v1/console/tokenize": LARGE_JSON_BYTES,   # one string: cheap to parse
    "/api/v1/console/detokenize": LARGE_JSON_BYTES,
}


class BodyLimits:
    def __init__(self, max_bytes: int, route_limits: dict[str, int | None] | None = None):
        """`max_bytes` (--max-body-bytes) bounds every route; a route not in `route_limits`
        (ROUTE_LIMITS by default) takes at most SMALL_BYTES."""
        routes = ROUTE_LIMITS if route_limits is None else route_limits
        self.routes = {path: min(max_bytes, limit or max_bytes) for path, limit in routes.items()}
        self.max_bytes = min(max_bytes, SMALL_BYTES)

    async def admit(self, scope, receive) -> tuple[dict, Receive, ASGIApp | None]:
        """(the scope and receive a route reads the body through, or the refusal to answer with).
        A zstd body is read and inflated here; a chunked one is counted as the route reads it."""
        limit = self.routes.get(scope["path"], self.max_bytes)
        length = encoding = None
        for key, value in scope["headers"]:
            if key == b"content-length":
                length = value
            elif key == b"content-encoding":
                encoding = value.decode("latin-1")
        if length is not None and (not length.isdigit() or int(length) > limit):
            return scope, receive, error_response(f"the request body is {length.decode('latin-1')} bytes; this "
                                                  f"server takes at most {limit}", 413)
        if encoding and "zstd" in encoding.lower():
            return await _inflated(scope, receive, encoding, limit)
        if length is None:          # chunked: count as it arrives (with a length, the server holds it to it)
            return scope, _counted(receive, limit), None
        return scope, receive, None


def _counted(receive: Receive, limit: int) -> Receive:
    seen = 0

    async def counted():
        nonlocal seen
        message = await receive()
        seen += len(message.get("body", b""))
        if seen > limit:       # the routes' error handler answers it (gateway/errors.py)
            raise HTTPException(413, f"the request body is over {limit} bytes")
        return message
    return counted


async def _inflated(scope, receive: Receive, encoding: str, limit: int) -> tuple[dict, Receive, ASGIApp | None]:
    chunks, size, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            return scope, receive, _gone            # the client went away
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        more = message.get("more_body", False)
        if size > limit:
            return scope, receive, error_response(f"the request body is over {limit} bytes", 413)
    try:
        body = convert.decompress(b"".join(chunks), encoding, limit)
    except UserError as e:
        return scope, receive, error_response(str(e), 413 if isinstance(e, convert.BodyTooLarge) else 400)
    headers = [(k, v) for k, v in scope["headers"] if k not in (b"content-encoding", b"content-length")]
    scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
    delivered = False

    async def plain():
        nonlocal delivered
        if delivered:
            return await receive()  # after the body: wait for a disconnect like the server would
        delivered = True
        return {"type": "http.request", "body": body, "more_body": False}
    return scope, plain, None


async def _gone(scope, receive, send) -> None:
    """Nothing to answer: the client left while its body was read."""
