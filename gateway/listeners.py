"""The gateway's two HTTP listeners, one app: the public one (the Tinker API, the console, the
OpenAI routes, signed downloads) and the internal one (`/internal/`: sampler replicas joining the
pool; `/metrics`: Prometheus, whose labels name users). The internal listener's server wraps the
app in `Listener`, which stamps the scope; a scope without a stamp is the public listener's (the
public server serves the app itself: the API's requests cross no wrapper). gateway/identity/auth.py
answers 404 for a path on the wrong listener, before any credential is looked at."""

from __future__ import annotations

PUBLIC, INTERNAL = "public", "internal"
SCOPE_KEY = "tinkerd.listener"
INTERNAL_PREFIX = "/internal/"
INTERNAL_PATHS = ("/metrics",)


def of(scope) -> str:
    return scope.get(SCOPE_KEY, PUBLIC)


def is_internal_path(path: str) -> bool:
    return path.startswith(INTERNAL_PREFIX) or path in INTERNAL_PATHS


def misplaced(scope) -> str | None:
    """Why the path is not served on this listener, or None."""
    path = scope.get("path", "")
    if of(scope) == INTERNAL:
        return None if is_internal_path(path) else (
            f"the internal listener serves {INTERNAL_PREFIX} and /metrics only; the API is on the public port")
    return f"no route {path} on this port" if is_internal_path(path) else None


class Listener:
    """ASGI wrapper: requests through it are `name`'s (lifespan events pass through untouched)."""

    def __init__(self, app, name: str):
        self.app, self.name = app, name

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            scope = {**scope, SCOPE_KEY: self.name}
        await self.app(scope, receive, send)
