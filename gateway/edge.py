"""The gateway's one ASGI middleware, the first of our frames every HTTP request enters: it is
counted and timed (gateway/metrics.py), its caller resolved or refused before its body is read
(gateway/identity/auth.py), and its body bounded, inflated if it came zstd, before a route sees
it (gateway/body_limit.py). Pure ASGI: no task or queue per request (retrieve_future is hot).

A route whose endpoint takes the Request alone (it reads and checks its body by hand: the hot
ones, every future's and every poll's) is called from here directly, its errors answered by the
app's exception handlers: what FastAPI would do for it, without the layers of middleware, route
matching, dependency solving and response validation between (what that saves:
docs/benchmarks.md#request_costs). tests/gateway/test_direct_routes.py holds the two ways equal.
"""

from __future__ import annotations

import time

from fastapi.encoders import jsonable_encoder
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Match
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway import metrics
from gateway.body_limit import BodyLimits
from gateway.identity.auth import Authentication


class Edge:
    def __init__(self, app: ASGIApp, authentication: Authentication, bodies: BodyLimits, routes: list,
                 handlers: dict):
        """`routes`: the app's (all added by the first request); `handlers`: its exception
        handlers, by exception class or status code (FastAPI.exception_handlers)."""
        self.app, self.authentication, self.bodies, self.routes = app, authentication, bodies, routes
        self.handlers = handlers
        self._direct: dict[tuple[str, str], APIRoute] | None = None

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
            route = None if refusal is not None else self.direct().get((scope["method"], scope["path"]))
            if route is not None:
                await self._call(route, scope, receive, send_status)
            else:
                await (refusal or self.app)(scope, receive, send_status)
        finally:
            metrics.observe(scope, status, time.perf_counter() - t0, self.routes)

    def direct(self) -> dict[tuple[str, str], APIRoute]:
        """(method, path) -> each route called directly: a fixed path, one method, an endpoint
        whose one parameter is the Request (no body model, no dependency), and no route before it
        that the router would take for that request instead."""
        if self._direct is None:
            self._direct = {}
            for i, route in enumerate(self.routes):
                if not _direct(route):
                    continue
                scope = {"type": "http", "method": next(iter(route.methods)), "path": route.path}
                if all(earlier.matches(scope)[0] != Match.FULL for earlier in self.routes[:i]):
                    self._direct[scope["method"], scope["path"]] = route
        return self._direct

    async def _call(self, route: APIRoute, scope: Scope, receive: Receive, send: Send) -> None:
        scope["route"], scope["endpoint"], scope["path_params"] = route, route.endpoint, {}
        request = Request(scope, receive, send)
        try:
            response = await route.endpoint(**{route.dependant.request_param_name: request})
        except Exception as exc:
            handler = self._handler(exc)
            if handler is None:
                raise
            response = await handler(request, exc)
            exc.__traceback__ = None
        if isinstance(response, BaseModel):     # as FastAPI serializes a route's model: by alias
            response = Response(response.model_dump_json(by_alias=True), media_type="application/json")
        elif not isinstance(response, Response):
            response = JSONResponse(jsonable_encoder(response))
        await response(scope, receive, send)

    def _handler(self, exc: Exception):
        """The app's handler of `exc`, looked up as Starlette's ExceptionMiddleware does."""
        if isinstance(exc, HTTPException) and exc.status_code in self.handlers:
            return self.handlers[exc.status_code]
        return next((self.handlers[cls] for cls in type(exc).__mro__ if cls in self.handlers), None)


def _direct(route) -> bool:
    d = getattr(route, "dependant", None)
    return isinstance(route, APIRoute) and len(route.methods) == 1 and "{" not in route.path and \
        bool(d.request_param_name) and not route.dependencies and not (
            d.path_params or d.query_params or d.header_params or d.cookie_params or d.body_params
            or d.dependencies or d.response_param_name or d.background_tasks_param_name)
