"""The HTTP server's connection limits (uvicorn's options for `tinkerd gateway`).

- `--max-connections`: beyond this many open connections or requests in progress, a new request
  gets 503 at once (uvicorn's `limit_concurrency`) instead of file descriptors and memory running
  out; the SDK retries a 503.
- `--keep-alive-timeout-s`: an idle kept-alive connection is closed after this long.
- `--header-timeout-s`: uvicorn has no deadline for a request's head, so a client could hold a
  connection forever by sending its headers a byte at a time (slowloris); the protocol below
  closes a connection whose request head is not complete this long after it connected or after
  the head's first byte arrived.
"""

from __future__ import annotations

from uvicorn.protocols.http.auto import AutoHTTPProtocol


def header_deadline_protocol(timeout_s: float) -> type:
    """uvicorn's HTTP protocol (httptools, else h11), closing connections whose head is late."""

    class HeaderDeadline(AutoHTTPProtocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._head_timer = None
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._head_timer is None and self._between_requests():
                self._arm()                      # the first byte of the next request's head
            super().data_received(data)
            if self._head_timer is not None and not self._between_requests():
                self._head_timer.cancel()        # its head is complete: the request runs
                self._head_timer = None

        def connection_lost(self, exc) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            super().connection_lost(exc)

        def _between_requests(self) -> bool:
            # Both protocols start a new cycle once a request's head is parsed.
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            self._head_timer = self.loop.call_later(timeout_s, self._head_late)

        def _head_late(self) -> None:
            self._head_timer = None
            if self._between_requests() and not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadline


def uvicorn_options(settings) -> dict:
    """The uvicorn.Config arguments for the gateway's `GatewaySettings`."""
    return {"limit_concurrency": settings.max_connections, "timeout_keep_alive": settings.keep_alive_timeout_s,
            "http": header_deadline_protocol(settings.header_timeout_s)}
