"""Prometheus metrics plumbing the trainer and the sampler share: the `--metrics-port` setting,
the HTTP endpoint serving `/metrics`, and the histogram of gRPC calls served (RPC_SECONDS, timed
by tinkerd/rpc.py's boundary of every call).

Each service defines its own metrics in its own module (trainer_service/metrics.py,
sampler_service/metrics.py, gateway/metrics.py) in prometheus_client's default registry, which
also holds the process collector (resident memory, CPU seconds, open files) and, in a sampler,
vLLM's own `vllm:` metrics. The gateway serves the same registry at `/metrics` on its HTTP port.

Names: `tinkerd_<service>_<what>_<unit>`; counters end in `_total` (rates give per-second
values, e.g. rate(tinkerd_trainer_tokens_total[1m]) is trained tokens/s). Label values are
bounded: methods, kinds and status codes, never ids.
"""

from __future__ import annotations

import dataclasses
import logging
import socket

from prometheus_client import Histogram

from tinkerd.errors import UserError
from tinkerd.settings import setting

log = logging.getLogger(__name__)

# Seconds, from a fast RPC (a cached reply) to a long training step on CPU.
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    120.0, 300.0)

RPC_SECONDS = Histogram("tinkerd_rpc_duration_seconds", "gRPC calls served, by method and status code, "
                        "from the request's arrival to the reply (queueing in the trainer's fair scheduler "
                        "included)", ["method", "code"], buckets=DURATION_BUCKETS)


@dataclasses.dataclass(kw_only=True)
class MetricsSettings:
    metrics_port: int = setting(-1, help="serve Prometheus /metrics over HTTP on this port, on the host of "
                                         "--listen (0 picks a free one and prints `METRICS <service> <port>`; "
                                         "-1: off)")


def serve(settings: MetricsSettings, listen: str, name: str) -> int | None:
    """Starts the /metrics endpoint (a daemon thread) if asked; returns its port. Printed as
    `METRICS <name> <port>` for `tinkerd up`, which lists it in <state-dir>/prometheus-targets.json.
    A port it cannot take is a UserError naming the flag (call it before loading a model)."""
    if settings.metrics_port < 0:
        return None
    from prometheus_client import start_http_server

    host = listen.rsplit(":", 1)[0].strip("[]") or "0.0.0.0"
    try:
        server, _ = start_http_server(settings.metrics_port, addr=host)
    except OSError as e:
        raise UserError(cannot_serve(host, settings.metrics_port, e)) from None
    port = server.server_port
    log.info("%s serving Prometheus metrics at http://%s:%d/metrics", name, host, port)
    print(f"METRICS {name} {port}", flush=True)
    return port


def check_port(host: str, port: int) -> None:
    """Raises UserError if /metrics could not be served on host:port now (for a launcher, before it
    starts the service that will)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)       # as http.server's listener
        try:
            s.bind((host, port))
        except OSError as e:
            raise UserError(cannot_serve(host, port, e)) from None


def cannot_serve(host: str, port: int, e: OSError) -> str:
    return (f"cannot serve /metrics on {host}:{port} (--metrics-port): {e.strerror}; pick another port, "
            f"0 for a free one, or -1 for none")
