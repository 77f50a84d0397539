"""The gateway's one ASGI middleware, the first of our frames every HTTP request enters: it is
counted and timed (gateway/metrics.py), its caller resolved or refused before its body is read
(gateway/identity/auth.py), and its body bounded, inflated if it came zstd, before a route sees
it (gateway/body_limit.py). Pure ASGI: no task or queue per request (retrieve_future is hot).
"""

from __future__ import annotations

import time

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway import metrics
from gateway.body_limit import BodyLimits
from gateway.identity.auth import Authentication


class Edge:
    def __init__(self, app: ASGIApp, authentication: Authentication, bodies: BodyLimits, routes: list):
        self.app, self.authentication, self.bodies, self.routes = app, authentication, bodies, routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = 500

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
        try:
            refusal = await self.authentication.refusal(scope)
            if refusal is None:
                scope, receive, refusal = await self.bodies.admit(scope, receive)
            await (refusal or self.app)(scope, receive, send_status)
        finally:
            metrics.observe(scope, status, time.perf_counter() - t0, self.routes)
