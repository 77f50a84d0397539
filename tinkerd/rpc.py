"""gRPC plumbing shared by the services: server construction, channels, and the boundary that
turns exceptions into status codes."""

from __future__ import annotations

import functools
import logging

import grpc

from tinkerd.errors import ServiceError

log = logging.getLogger(__name__)

# Training batches and weight manifests can be large; the default 4 MiB cap is not enough.
MAX_MESSAGE_BYTES = 512 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def create_server(address: str, *, max_workers: int = 32) -> tuple[grpc.Server, int]:
    """A threaded server bound to `address` (port 0 picks one); returns it with its port."""
    from concurrent import futures

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=CHANNEL_OPTIONS)
    port = server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"could not bind gRPC server to {address}")
    return server, port


def channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)


def aio_channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


def rpc_boundary(method):
    """Servicer decorator: ServiceError -> its status code; anything else -> INTERNAL, logged."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except ServiceError as e:
            context.abort(e.code, str(e))
        except Exception as e:  # noqa: BLE001 - the boundary must answer, never crash the server
            log.exception("%s failed", method.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")

    return wrapper
