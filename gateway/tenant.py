"""Whom the request being served is for: set by the futures around a job (gateway/futures/store.py),
read where a service call is made (gateway/backends.py sends it as gRPC metadata, so the trainer's
fair scheduler knows whose work it runs)."""

from __future__ import annotations

import contextvars

TENANT: contextvars.ContextVar[str] = contextvars.ContextVar("tenant", default="")
