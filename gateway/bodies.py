"""JSON request bodies parsed and validated off the event loop when they are large.

Parsing a JSON body and validating it cost ~0.1 ms per KiB of small values (a token list): on the
loop, a 1.5 MB prompt would hold up every tenant's requests for a quarter of a second. The routes
whose bodies may be large by nature (a prompt, a list of ids: gateway/body_limit.py LARGE_JSON)
read them here; every other JSON route's body is capped small before it is read.
"""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from gateway.protocol import parse_json

OFF_LOOP_BYTES = 32 << 10       # larger bodies are parsed in a thread (a few ms of work beyond this)

M = TypeVar("M", bound=BaseModel)


async def json_of(request: Request, parse=parse_json) -> Any:
    """The body as JSON (`parse`: how, raising the route's own error for a body that is not)."""
    raw = await request.body()
    return parse(raw) if len(raw) <= OFF_LOOP_BYTES else await asyncio.to_thread(parse, raw)


async def model_of(request: Request, model: type[M], parse=parse_json) -> M:
    """The body as `model` (a pydantic ValidationError is the gateway's 400)."""
    raw = await request.body()

    def read() -> M:
        return model.model_validate(parse(raw))
    return read() if len(raw) <= OFF_LOOP_BYTES else await asyncio.to_thread(read)


async def model_request_of(request: Request, model: type[M]) -> M:
    """A model's request body (model_id, seq_id: a training request) as `model`, read by hand as
    FastAPI reads a body model, and refused as it refuses one: a RequestValidationError with the
    body, which gateway/errors.py records as refused in the model's order."""
    data = await json_of(request)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError(e.errors(), body=data) from None
