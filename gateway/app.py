"""The Tinker REST API (as SDK 0.38 speaks it) on top of the Trainer and Sampler gRPC services.

create_app only assembles: the runtime parts (gateway/state.py), the one middleware
(gateway/edge.py: metrics, authentication, body limits), the error handlers (gateway/errors.py)
and the routes (gateway/routes/, one module per concern). Immediate calls answer from the
database; slow calls become futures (gateway/futures/store.py) whose jobs call gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import FastAPI

from gateway import console, errors, housekeeping, metrics
from gateway.backends import Backends
from gateway.body_limit import BodyLimits
from gateway.edge import Edge
from gateway.identity import limits
from gateway.jobs.context import JobContext
from gateway.jobs.engine import Jobs
from gateway.jobs.table import JOBS
from gateway.identity.auth import Authentication
from gateway.routes import ROUTERS
from gateway.settings import GatewaySettings
from gateway.state import Gateway

log = logging.getLogger(__name__)


def create_app(settings: GatewaySettings) -> FastAPI:
    gw = Gateway.create(settings)
    gw.jobs = Jobs(gw.futures, gw.limits, gw.db, settings, JOBS)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        gw.backends = Backends(settings, gw.db, gw.service_auth)
        gw.jobs.context = JobContext(trainer=gw.backends.trainer, samplers=gw.backends.samplers, db=gw.db,
                                     stability=gw.stability, drained=gw.futures.drained,
                                     served_model=settings.base_model,
                                     in_background=gw.in_background)      # what every job runs with
        reaper = asyncio.create_task(housekeeping.run_forever(gw))
        leases = asyncio.create_task(gw.jobs.keep_leases_forever())   # re-drives a stopped gateway's futures
        spans = asyncio.create_task(gw.traces.flush_forever())           # request spans to the database
        peers = gw.futures.peers.listen(gw.futures.heard)       # what other gateways finish, at once
        completions = asyncio.create_task(gw.futures.completions.watch_forever())   # ... and as a net
        yield
        completions.cancel()
        spans.cancel()
        leases.cancel()
        reaper.cancel()
        gw.jobs.stop()
        peers()
        await gw.backends.close()

    app = FastAPI(title="tinkerd gateway", lifespan=lifespan)
    app.state.gateway = gw
    errors.install(app)
    app.add_exception_handler(limits.OverLimit, limits.on_over_limit)
    app.add_middleware(Edge, authentication=Authentication(gw.authenticator, lambda: gw.service_auth),
                       bodies=BodyLimits(settings.max_body_bytes), routes=app.router.routes,
                       handlers=app.exception_handlers)
    for router in ROUTERS:
        app.include_router(router)
    app.include_router(console.api_router)          # the web console (gateway/console/)
    app.include_router(console.page_router)
    metrics.install(app, gw)        # GET /metrics
    return app
