"""The gateway's Prometheus metrics, served at `GET /metrics` on its internal listener (gateway/
listeners.py; the users' port answers 404) without an API key: a scraper has none. It shows user
ids as label values of the queue depths, which is why it is not on the users' port.

Requests are labelled by route template (`/api/v1/samplers/{sampler_id:path}`, never the raw
path) and status, so the label sets stay bounded; paths no route matches share one template.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from starlette.routing import Match

from tinkerd.metrics import DURATION_BUCKETS

UNMATCHED = "(unmatched)"

REQUESTS = Counter("tinkerd_gateway_requests_total", "HTTP requests answered, by method, route template and "
                   "status code", ["method", "route", "status"])
REQUEST_SECONDS = Histogram("tinkerd_gateway_request_duration_seconds", "HTTP request latency, by method and "
                            "route template (retrieve_future long-polls: its latency includes the wait)",
                            ["method", "route"], buckets=DURATION_BUCKETS)
TOKENS = Counter("tinkerd_gateway_tokens_total", "tokens of completed calls, by kind: trained "
                 "(forward_backward), forward (forward only) and sampled (generated, all sequences)", ["kind"])
SNAPSHOT_PUSHES = Histogram("tinkerd_gateway_snapshot_push_duration_seconds", "save_weights_for_sampler: the "
                            "trainer's PushWeights to every live sampler replica", buckets=DURATION_BUCKETS)
EVENT_LOOP = Gauge("tinkerd_gateway_event_loop_info", "the event loop the gateway runs on, by its module "
                   "(uvloop where installed: gateway/server.py event_loop)", ["loop"])
SNAPSHOT_PUSH_BYTES = Counter("tinkerd_gateway_snapshot_push_bytes_total", "adapter bytes pushed to samplers")

# Every future type the routes submit (gateway/routes/): reported even at zero, so a dashboard
# sees the series before the first request.
FUTURE_TYPES = ("create_model", "forward", "forward_backward", "optim_step", "save_weights_for_sampler",
                "save_weights", "save_external_weights", "load_weights", "sample", "noop")


class PendingCollector:
    """Futures pending, by type and by user (only users with work pending), read at scrape time
    from the latest gateway made in this process."""

    def __init__(self):
        self.gateway = None

    def collect(self):
        by_type = GaugeMetricFamily("tinkerd_gateway_futures_pending", "futures scheduled and not finished, by "
                                    "request type", labels=["type"])
        by_user = GaugeMetricFamily("tinkerd_gateway_queue_depth", "futures pending per user (users with none "
                                    "are left out), by class: training or sample", labels=["user", "class"])
        gw = self.gateway
        if gw is not None:
            futures = gw.futures
            for request_type in FUTURE_TYPES:
                by_type.add_metric([request_type], futures.pending(request_type))
            for user in futures.owners_pending():
                samples = futures.pending_of(user, "sample")
                by_user.add_metric([user, "training"], futures.pending_of(user) - samples)
                by_user.add_metric([user, "sample"], samples)
        yield by_type
        yield by_user


PENDING = PendingCollector()
REGISTRY.register(PENDING)


def trained(msg) -> None:
    """A forward_backward (trainer_pb2.ForwardBackwardRequest) completed."""
    TOKENS.labels("forward" if msg.forward_only else "trained").inc(sum(len(d.tokens) for d in msg.data))


def sampled(reply) -> None:
    """A sample (sampler_pb2.SampleResponse) completed."""
    TOKENS.labels("sampled").inc(sum(len(s.tokens) for s in reply.sequences))


def pushed(reply, seconds: float) -> None:
    """A snapshot push (trainer_pb2.PushWeightsResponse) completed."""
    SNAPSHOT_PUSHES.observe(seconds)
    SNAPSHOT_PUSH_BYTES.inc(reply.num_bytes)


def observe(scope, status: int, seconds: float, routes) -> None:
    """One HTTP request counted and timed by its route's template (gateway/edge.py), refusals
    by authentication and body limits too."""
    route = scope.get("route")
    if route is None:     # refused before routing, or the body limit routed a copy of the scope
        route = next((r for r in routes if r.matches(scope)[0] == Match.FULL), None)
    template = getattr(route, "path", None) or UNMATCHED
    key = (scope["method"], template, status)
    series = _SERIES.get(key)
    if series is None:
        series = _SERIES[key] = (REQUESTS.labels(key[0], template, str(status)),
                                 REQUEST_SECONDS.labels(key[0], template))
    series[0].inc()
    series[1].observe(seconds)


# (method, route template, status) -> its two series: `labels` builds and locks on every call, and
# every request is counted. Bounded as the label sets are (templates, not paths).
_SERIES: dict[tuple[str, str, int], tuple] = {}


router = APIRouter()


@router.get("/metrics", include_in_schema=False)
async def metrics() -> Response:
    EVENT_LOOP.labels(type(asyncio.get_running_loop()).__module__).set(1)
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)


def install(app: FastAPI, gateway) -> None:
    """GET /metrics, and the gauges read from `gateway`."""
    PENDING.gateway = gateway
    app.include_router(router)
