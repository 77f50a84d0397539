"""Errors as the SDK reads them: the Tinker error body `{"error", "category"}` is built here and
nowhere else, with the category taken from tinkerd/errors.py's one table."""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from tinkerd.errors import NotFoundError, UserError, category_for_http


RETRY_AFTER_S = 2


class OverLimit(Exception):
    """A limit that frees up by waiting (gateway/identity/limits.py): 429, with when to retry."""

    def __init__(self, message: str, retry_after_s: int = RETRY_AFTER_S):
        super().__init__(message)
        self.retry_after_s = retry_after_s


def error_body(message: str, category: str) -> dict:
    return {"error": message, "category": category, "detail": message}


def error_json(message: str, category: str) -> bytes:
    """A failed future's stored result."""
    return json.dumps(error_body(message, category)).encode()


def error_response(message: str, status: int = 400, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, category_for_http(status)), status_code=status, headers=headers)


def _field_errors(exc: RequestValidationError | ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        msg = err.get("msg", "invalid").removeprefix("Value error, ")
        parts.append(f"{where}: {msg}" if where else msg)      # a whole-body check names its field itself
    return "; ".join(parts)


async def _on_user_error(request: Request, exc: UserError) -> JSONResponse:
    return error_response(str(exc), 404 if isinstance(exc, NotFoundError) else 400)


async def _on_invalid_body(request: Request, exc: RequestValidationError | ValidationError) -> JSONResponse:
    message = f"invalid request: {_field_errors(exc)}"
    if isinstance(exc, RequestValidationError):
        await _refused_in_order(request, exc.body, message)
    return error_response(message)


async def _refused_in_order(request: Request, body, message: str) -> None:
    """A model's request (model_id, seq_id) refused for its body is recorded as refused in the
    model's order, as a route's own refusals are (Gateway.refusing): the model's next request
    then runs at once instead of waiting out the gap its seq_id left."""
    caller = getattr(request.state, "caller", None)
    if not isinstance(body, dict) or caller is None:
        return
    model_id, seq_id = body.get("model_id"), body.get("seq_id")
    if not isinstance(model_id, str) or type(seq_id) is not int or not 0 <= seq_id < 2**63:
        return
    gw = request.app.state.gateway          # gateway/state.py's Gateway (imported there, not here)
    try:
        await gw.sessions.live_model(caller, model_id)          # only the caller's own, open model
        async with gw.refusing(caller, model_id, seq_id):
            raise UserError(message)
    except UserError:
        pass


def _http_message(exc: HTTPException) -> str:
    """FastAPI's "error parsing the body" said plainly: its cause is the client's body."""
    cause = exc.__cause__
    if isinstance(cause, RecursionError):
        return "the JSON body is nested too deeply"
    if isinstance(cause, UnicodeDecodeError):
        return f"the body is not valid UTF-8: {cause}"
    if isinstance(cause, ValueError):
        return f"the body is not valid JSON: {cause}"
    return str(exc.detail)


async def _on_http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own errors (unknown route 404, 405, 413 from gateway/body_limit.py) in the
    Tinker error body."""
    return error_response(_http_message(exc), exc.status_code, exc.headers)


def install(app: FastAPI) -> None:
    app.add_exception_handler(HTTPException, _on_http_error)
    app.add_exception_handler(UserError, _on_user_error)
    app.add_exception_handler(RequestValidationError, _on_invalid_body)
    app.add_exception_handler(ValidationError, _on_invalid_body)      # bodies a route validates itself
