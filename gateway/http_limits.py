"""The HTTP server's connection limits (uvicorn's options for `tinkerd gateway`).

- `--max-connections`: beyond this many open connections or requests in progress, a new request
  gets 503 at once (uvicorn's `limit_concurrency`) instead of file descriptors and memory running
  out; the SDK retries a 503. The process's open-files limit is raised to fit them
  (`fit_open_files`): a soft limit of 1,024, common, would refuse connections far below it.
- `--keep-alive-timeout-s`: an idle kept-alive connection is closed after this long.
- `--header-timeout-s`: uvicorn has no deadline for a request's head, so a client could hold a
  connection forever by sending its headers a byte at a time (slowloris); the protocol below
  closes a connection whose request head is not complete this long (to twice this long) after it
  connected or after the head's first byte arrived.

And a response's head goes out with its body, in one system call (`HeadWithBody`): uvicorn
writes them apart.
"""

from __future__ import annotations

import logging
import resource

from uvicorn.protocols.http.auto import AutoHTTPProtocol

log = logging.getLogger(__name__)
OTHER_FILES = 1024       # the database, the listeners, gRPC channels, logs, the model's files


def header_deadline_protocol(timeout_s: float) -> type:
    """uvicorn's HTTP protocol (httptools, else h11), closing connections whose head is late.

    It only watches, from a timer: a request's bytes and its task pass through uvicorn's own
    methods, with no frame of ours on the request's path. Every `timeout_s` it looks at the
    connection; a head begun (bytes came since the last response, or since it connected) and
    still not complete at two looks in a row has taken at least `timeout_s`: the connection is
    closed. An idle kept-alive connection is uvicorn's keep-alive timeout's to close."""

    class HeaderDeadline(AutoHTTPProtocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.transport = HeadWithBody(transport, self.loop)     # what the requests' cycles write to
            self._late_cycle = _NOT_LOOKED
            self._look = self.loop.call_later(timeout_s, self._look_at_head)

        def connection_lost(self, exc) -> None:
            self._look.cancel()
            super().connection_lost(exc)

        def _look_at_head(self) -> None:
            if self.transport.is_closing():
                return
            # Both protocols start a new cycle once a request's head is parsed; uvicorn's keep-alive
            # timer runs from a response until the next request's first byte.
            waiting_for_head = self.cycle is None or self.cycle.response_complete
            if waiting_for_head and self.timeout_keep_alive_task is None:
                if self._late_cycle is self.cycle:
                    self.transport.close()            # the same head, incomplete at two looks
                    return
                self._late_cycle = self.cycle
            else:
                self._late_cycle = _NOT_LOOKED
            self._look = self.loop.call_later(timeout_s, self._look_at_head)

    return HeaderDeadline


_NOT_LOOKED = object()


class HeadWithBody:
    """A connection's transport that sends a response's head with its body, in one system call.
    uvicorn writes a response's status line and headers, then its body: on a TCP_NODELAY socket,
    two sends and two segments, which wake the client twice (what one costs:
    docs/benchmarks.md#request_costs). A head is held until the next write (its body, sent with
    it at once), a close or an EOF, or the end of the loop's turn (a head with no body yet, or an
    interim 100 Continue)."""

    def __init__(self, transport, loop):
        self._transport, self._loop = transport, loop
        self._head = b""

    def write(self, data: bytes) -> None:
        if self._head:
            data, self._head = self._head + data, b""
            self._transport.write(data)
        elif data.startswith(b"HTTP/") and data.endswith(b"\r\n\r\n"):
            self._head = bytes(data)
            self._loop.call_soon(self._send)
        else:
            self._transport.write(data)

    def _send(self) -> None:
        head, self._head = self._head, b""
        if head and not self._transport.is_closing():     # a connection lost in the meantime takes nothing
            self._transport.write(head)

    def writelines(self, lines) -> None:
        for data in lines:
            self.write(data)

    def write_eof(self) -> None:
        self._send()
        self._transport.write_eof()

    def close(self) -> None:
        self._send()
        self._transport.close()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + len(self._head)

    def __getattr__(self, name):
        return getattr(self._transport, name)


def fit_open_files(connections: int) -> int:
    """Raises this process's soft open-files limit toward its hard one, to `connections` and
    OTHER_FILES more; says so when the hard limit is lower. Returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = connections + OTHER_FILES
    if soft == resource.RLIM_INFINITY or soft >= want:
        return soft
    new = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if new > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    if new < want:
        log.warning("the open-files limit is %d (its hard limit): fewer connections than --max-connections %d "
                    "can be open at once; raise it (ulimit -n, the container's nofile) or lower "
                    "--max-connections", new, connections)
    return new


def uvicorn_options(settings) -> dict:
    """The uvicorn.Config arguments for the gateway's `GatewaySettings`."""
    # proxy_headers off: which proxy's forwarding headers are believed is --trusted-proxy's to say
    # (gateway/public_url.py), and it must see the proxy's own address to say it.
    return {"limit_concurrency": settings.max_connections, "timeout_keep_alive": settings.keep_alive_timeout_s,
            "http": header_deadline_protocol(settings.header_timeout_s), "proxy_headers": False}
