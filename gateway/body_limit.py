"""Request bodies bounded before any route sees them: a pure ASGI middleware (not Starlette's
BaseHTTPMiddleware, which costs every request a task and a queue; retrieve_future is hot).

A body over `max_bytes` is a 413 with the Tinker error body: at once when Content-Length says so,
else as soon as the bytes read pass the limit. A zstd body (the SDK compresses forward_backward)
is inflated here, never past the same limit, and handed on plain, without Content-Encoding.
Routes whose bodies are small by nature have a smaller limit (ROUTE_LIMITS).
"""

from __future__ import annotations

from starlette.exceptions import HTTPException

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


class BodyLimit:
    def __init__(self, app, max_bytes: int, route_limits: dict[str, int | None] | None = None):
        """`max_bytes` (--max-body-bytes) bounds every route; a route not in `route_limits`
        takes at most SMALL_BYTES (with `route_limits` given as {}: `max_bytes`, for the routes'
        own instances)."""
        self.app = app
        routes = ROUTE_LIMITS if route_limits is None else route_limits
        self.routes = {path: BodyLimit(app, min(max_bytes, limit or max_bytes), {}) for path, limit in routes.items()}
        self.max_bytes = min(max_bytes, SMALL_BYTES) if route_limits is None else max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if (smaller := self.routes.get(scope["path"])) is not None:
            return await smaller(scope, receive, send)
        length = encoding = None
        for key, value in scope["headers"]:
            if key == b"content-length":
                length = value
            elif key == b"content-encoding":
                encoding = value.decode("latin-1")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await self._refuse(scope, receive, send, 413, f"the request body is {length.decode('latin-1')} "
                                      f"bytes; this server takes at most {self.max_bytes}")
        if encoding and "zstd" in encoding.lower():
            return await self._inflated(scope, receive, send, encoding)
        if length is None:          # chunked: count as it arrives (with a length, the server holds it to it)
            receive = self._counted(receive)
        await self.app(scope, receive, send)

    def _counted(self, receive):
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:       # the routes' error handler answers it (gateway/errors.py)
                raise HTTPException(413, f"the request body is over {self.max_bytes} bytes")
            return message
        return counted

    async def _inflated(self, scope, receive, send, encoding: str) -> None:
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return                  # the client went away
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_bytes:
                return await self._refuse(scope, receive, send, 413, f"the request body is over {self.max_bytes} bytes")
        try:
            body = convert.decompress(b"".join(chunks), encoding, self.max_bytes)
        except UserError as e:
            return await self._refuse(scope, receive, send, 413 if isinstance(e, convert.BodyTooLarge) else 400, str(e))
        headers = [(k, v) for k, v in scope["headers"] if k not in (b"content-encoding", b"content-length")]
        scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        delivered = False

        async def plain():
            nonlocal delivered
            if delivered:
                return await receive()  # after the body: wait for a disconnect like the server would
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await self.app(scope, plain, send)

    @staticmethod
    async def _refuse(scope, receive, send, status: int, message: str) -> None:
        await error_response(message, status)(scope, receive, send)
