"""OpenAI-compatible inference over the base model and any sampler checkpoint, under the prefix
hosted Tinker uses (`/oai/api/v1`): GET /models, POST /chat/completions, POST /completions.

`model` is a base model name (or alias) or a `tinker://<run>/sampler_weights/<name>` path the
caller may read (theirs or published; anyone else's is 404, as everywhere). Each request is a
sample like `asample`'s: the same body checks (gateway/convert.py), the same per-user and server
limits (gateway/limits.py), a "sample" future in the same scheduler (gateway/futures.py) whose job
is asample's own (routes/sampling.py), on the same sampler pool. The gateway holds the model's
tokenizer: it renders chat messages with the tokenizer's chat template and decodes the tokens.

Streaming (`stream: true`) sends server-sent events in OpenAI's chunk format ending in
`data: [DONE]`; the sampler's gRPC API returns whole completions, so the chunks (one per
token) are sent once the completion is done, not as the engine makes them.

Errors use OpenAI's shape `{"error": {"message", "type", "param", "code"}}`: 4xx for what the
caller can fix, 429 with Retry-After over a limit.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import time
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field, ValidationError, field_validator
from sqlalchemy import select

from gateway import convert, protocol
from gateway import tinker_wire_pb2 as tw
from gateway.auth import caller_of
from gateway.db import CheckpointRow
from gateway.errors import _field_errors
from gateway.keys import Caller
from gateway.limits import OverLimit
from gateway.routes import sampling
from gateway.state import Gateway, gateway_of
from tinkerd.errors import NotFoundError, UserError

router = APIRouter(prefix="/oai/api/v1")

MAX_N = 128                 # OpenAI's own bound on `n`
MAX_LOGPROBS = protocol.MAX_TOPK_LOGPROBS
_WAIT_S = 25.0              # one wait on the future; repeated until it finishes


# ---- errors ------------------------------------------------------------------------------

class OaiError(Exception):
    def __init__(self, message: str, status: int = 400, *, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.param, self.code, self.headers = status, param, code, headers


_TYPES = {401: "authentication_error", 404: "invalid_request_error", 429: "rate_limit_exceeded"}


def _error(e: OaiError) -> JSONResponse:
    kind = _TYPES.get(e.status, "invalid_request_error" if e.status < 500 else "server_error")
    return JSONResponse({"error": {"message": str(e), "type": kind, "param": e.param, "code": e.code}},
                        status_code=e.status, headers=e.headers)


def _openai_errors(route):
    """The Tinker errors the shared code raises, in OpenAI's shape."""
    @functools.wraps(route)
    async def wrapped(request: Request):
        try:
            return await route(request)
        except OaiError as e:
            return _error(e)
        except NotFoundError as e:
            return _error(OaiError(str(e), 404, code="model_not_found"))
        except UserError as e:
            return _error(OaiError(str(e)))
        except ValidationError as e:
            return _error(OaiError(f"invalid request: {_field_errors(e)}"))
        except OverLimit as e:
            return _error(OaiError(str(e), 429, headers={"Retry-After": str(e.retry_after_s)}))
    return wrapped


async def _body(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except (ValueError, RecursionError) as e:
        raise OaiError(f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise OaiError("the body must be a JSON object")
    return body


# ---- request bodies ------------------------------------------------------------------------

class _Common(protocol.Request):
    model: protocol.Id
    max_tokens: int | None = Field(None, ge=1, le=protocol.INT32)
    temperature: float = Field(1.0, ge=0, le=protocol.MAX_TEMPERATURE)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: Any = None                  # checked as asample's sampling_params.stop
    seed: protocol.Seed | None = None
    stream: bool = False
    stream_options: dict[str, Any] = {}
    # Accepted by OpenAI, not served here: refused rather than ignored.
    tools: Any = None
    functions: Any = None
    response_format: Any = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, Any] = {}

    def refuse_unsupported(self) -> None:
        for name in ("tools", "functions", "response_format", "presence_penalty", "frequency_penalty",
                     "logit_bias"):
            value = getattr(self, name)
            if value and not (name == "response_format" and isinstance(value, dict)
                              and value.get("type") == "text"):
                raise OaiError(f"{name} is not supported by this server", param=name)


class TextPart(protocol.Body):
    type: Literal["text"]
    text: str


class Message(protocol.Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] = ""

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=protocol.INT32)
    logprobs: bool = False
    top_logprobs: int = Field(0, ge=0, le=MAX_LOGPROBS)


class CompletionRequest(_Common):
    prompt: str | list[protocol.Token]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if not v:
            raise ValueError("the prompt is empty")
        return v


# ---- the model: base or snapshot -------------------------------------------------------------

def _model(gw: Gateway, caller: Caller, name: str) -> tuple[str, str]:
    """(snapshot_id, snapshot_path) to sample `name`: ("", "") for the base model."""
    if name in gw.settings.model_names:
        return "", ""
    if not name.startswith("tinker://"):
        raise OaiError(f"the model {name!r} does not exist; GET /oai/api/v1/models lists them", 404,
                       param="model", code="model_not_found")
    ckpt = gw.sessions.readable_checkpoint(caller, name)
    if ckpt.checkpoint_type != "sampler":
        raise OaiError(f"{name!r} is not a sampler checkpoint (save_weights_for_sampler makes one)",
                       param="model")
    return ckpt.snapshot_id, ckpt.snapshot_path


@functools.lru_cache(maxsize=4)
def _tokenizer(model_dir: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


async def tokenizer_of(gw: Gateway):
    return await asyncio.to_thread(_tokenizer, gw.settings.base_model)


# ---- sampling: asample's path ----------------------------------------------------------------

async def _sample(gw: Gateway, caller: Caller, prompt: list[int], req: _Common, max_tokens: int | None,
                  topk: int) -> tuple[str, tw.SampleResponse]:
    """One sample request as asample makes it: checked, limited, run as a "sample" future."""
    snapshot_id, snapshot_path = _model(gw, caller, req.model)
    limits = convert.model_limits(gw.settings.base_model, gw.settings.max_model_len)
    if max_tokens is None:           # OpenAI's default: up to the context
        max_tokens = max(limits.max_model_len - len(prompt), 1)
    body = protocol.SampleRequest(
        num_samples=req.n, prompt=protocol.ModelInput(chunks=[protocol.PromptChunk(tokens=prompt)]),
        sampling_params=protocol.SamplingParams(max_tokens=max_tokens, temperature=req.temperature,
                                                top_p=req.top_p, seed=req.seed, stop=req.stop),
        topk_sample_logprobs=topk)
    convert.check_sample(body, limits)
    msg = convert.sample_request(body, snapshot_id, snapshot_path)
    gw.limits.check_samples(caller)
    row = gw.futures.submit("sample", functools.partial(sampling._sample, gw, msg, None), owner=caller.user_id)
    msg.request_id = row.request_id
    while (row := await gw.futures.wait(row.request_id, _WAIT_S, caller.user_id)).status == "pending":
        pass
    if row.status != "complete":
        error = json.loads(row.result)
        raise OaiError(error.get("error", "sampling failed"), 400 if error.get("category") == "user" else 503)
    reply = tw.SampleResponse()
    reply.ParseFromString(row.result)
    return row.request_id, reply



# ---- decoding: tokens -> text, pieces, logprobs ------------------------------------------------

@dataclasses.dataclass
class Choice:
    tokens: list[int]
    logprobs: list[float]
    topk: list[list[tuple[int, float]]]     # per token: the top alternatives (empty if not asked)
    pieces: list[str]                       # the text each token adds (they join to `text`)
    finish_reason: str

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def _pieces(tok, tokens: list[int]) -> list[str]:
    """Each token's share of the decoded text, decoding a few tokens at a time (a character can
    span tokens: its bytes show up with the token that completes it)."""
    pieces, prefix, read = [], 0, 0
    for i in range(len(tokens)):
        before = tok.decode(tokens[prefix:read], skip_special_tokens=True)
        after = tok.decode(tokens[prefix:i + 1], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            pieces.append(after[len(before):])
            prefix, read = read, i + 1
        else:
            pieces.append("")
    if read < len(tokens) and pieces:      # an unfinished character at the end: as the tokenizer decodes it
        before = tok.decode(tokens[prefix:read], skip_special_tokens=True)
        pieces[-1] = tok.decode(tokens[prefix:], skip_special_tokens=True)[len(before):]
    return pieces


def _cut_at_stop(pieces: list[str], stops: list[str]) -> tuple[list[str], bool]:
    """OpenAI's completions end before the stop string; the sampler's tokens include it."""
    text = "".join(pieces)
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    if cut < 0:
        return pieces, False
    out, length = [], 0
    for piece in pieces:
        keep = piece[:max(cut - length, 0)]
        out.append(keep)
        length += len(piece)
    return out, True


def _choices(tok, reply: tw.SampleResponse, stop) -> list[Choice]:
    stops = [stop] if isinstance(stop, str) else [s for s in (stop or []) if isinstance(s, str)]
    out = []
    for seq in reply.sequences:
        tokens = np.frombuffer(seq.tokens, dtype="<i4").tolist()
        topk: list[list[tuple[int, float]]] = [[] for _ in tokens]
        if seq.HasField("topk_sampled_logprobs") and seq.topk_sampled_logprobs.k:
            k = seq.topk_sampled_logprobs.k
            ids = np.frombuffer(seq.topk_sampled_logprobs.token_ids, dtype="<i4").reshape(-1, k).tolist()
            lps = np.frombuffer(seq.topk_sampled_logprobs.logprobs, dtype="<f4").reshape(-1, k).tolist()
            topk = [[(t, lp) for t, lp in zip(row_ids, row_lps) if lp > -9999.0] for row_ids, row_lps in zip(ids, lps)]
        pieces, stopped = _cut_at_stop(_pieces(tok, tokens), stops)
        finish = "length" if seq.stop_reason == tw.STOP_REASON_LENGTH and not stopped else "stop"
        out.append(Choice(tokens, np.frombuffer(seq.logprobs, dtype="<f4").tolist(), topk, pieces, finish))
    return out


def _token_text(tok, token: int) -> str:
    return tok.decode([token])


def _chat_logprob(tok, token: int, logprob: float, topk: list[tuple[int, float]]) -> dict:
    text = _token_text(tok, token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode()),
            "top_logprobs": [{"token": (t := _token_text(tok, i)), "logprob": lp, "bytes": list(t.encode())}
                             for i, lp in topk]}


def _completion_logprobs(tok, c: Choice, start: int = 0, end: int | None = None, offset: int = 0) -> dict:
    """The legacy completions logprobs object for tokens [start, end) of a choice."""
    end = len(c.tokens) if end is None else end
    tokens = [_token_text(tok, t) for t in c.tokens[start:end]]
    offsets = list(np.cumsum([offset] + [len(p) for p in c.pieces[start:end]])[:-1].tolist())
    return {"tokens": tokens, "token_logprobs": c.logprobs[start:end],
            "top_logprobs": [{_token_text(tok, i): lp for i, lp in k} for k in c.topk[start:end]],
            "text_offset": offsets}


def _usage(prompt: list[int], choices: list[Choice]) -> dict:
    completion = sum(len(c.tokens) for c in choices)
    return {"prompt_tokens": len(prompt), "completion_tokens": completion, "total_tokens": len(prompt) + completion}


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _stream(chunks) -> StreamingResponse:
    async def events():
        for chunk in chunks:
            yield _sse(chunk)
        yield b"data: [DONE]\n\n"
    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


# ---- routes ----------------------------------------------------------------------------------

def _model_card(model_id: str, created: int, owner: str) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": owner}


def _models(gw: Gateway, caller: Caller) -> list[dict]:
    cards = [_model_card(name, 0, "tinkerd") for name in gw.settings.model_names]
    rows = gw.db.select(select(CheckpointRow).where(CheckpointRow.owner == caller.user_id,
                                                    CheckpointRow.checkpoint_type == "sampler")
                        .order_by(CheckpointRow.created_at))
    return cards + [_model_card(r.tinker_path, int(r.created_at.timestamp()), caller.user_id) for r in rows]


@router.get("/models")
@_openai_errors
async def list_models(request: Request):
    """The base model's names and the caller's sampler checkpoints."""
    return {"object": "list", "data": _models(gateway_of(request), caller_of(request))}


@router.get("/models/{model:path}")
@_openai_errors
async def get_model(request: Request):
    gw, caller, name = gateway_of(request), caller_of(request), request.path_params["model"]
    if name not in gw.settings.model_names:
        row = gw.sessions.readable_checkpoint(caller, name)
        if row.checkpoint_type != "sampler":
            raise OaiError(f"{name!r} is not a sampler checkpoint", 404, param="model", code="model_not_found")
        return _model_card(name, int(row.created_at.timestamp()), row.owner)
    return _model_card(name, 0, "tinkerd")


@router.post("/chat/completions")
@_openai_errors
async def chat_completions(request: Request):
    gw, caller = gateway_of(request), caller_of(request)
    req = ChatRequest.model_validate(await _body(request))
    req.refuse_unsupported()
    tok = await tokenizer_of(gw)
    if not tok.chat_template:
        raise OaiError("this model's tokenizer has no chat template; use /completions", param="messages")
    try:
        text = tok.apply_chat_template([{"role": m.role, "content": m.text()} for m in req.messages],
                                       tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - a template may raise anything (jinja's raise_exception) on odd input
        raise OaiError(f"the chat template refused these messages: {e}", param="messages") from None
    prompt = tok.encode(text, add_special_tokens=False)
    request_id, reply = await _sample(gw, caller, prompt, req, req.max_completion_tokens or req.max_tokens,
                                      req.top_logprobs if req.logprobs else 0)
    choices = _choices(tok, reply, req.stop)
    head = {"id": f"chatcmpl-{request_id}", "created": int(time.time()), "model": req.model}

    def logprobs(c: Choice, start: int, end: int):
        if not req.logprobs:
            return None
        return {"content": [_chat_logprob(tok, t, lp, k)
                            for t, lp, k in zip(c.tokens[start:end], c.logprobs[start:end], c.topk[start:end])]}

    if not req.stream:
        return {**head, "object": "chat.completion", "usage": _usage(prompt, choices), "choices": [
            {"index": i, "message": {"role": "assistant", "content": c.text}, "logprobs": logprobs(c, 0, None),
             "finish_reason": c.finish_reason} for i, c in enumerate(choices)]}

    def chunk(i: int, delta: dict, finish: str | None = None, lp=None) -> dict:
        return {**head, "object": "chat.completion.chunk",
                "choices": [{"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}]}

    def chunks():
        for i, c in enumerate(choices):
            yield chunk(i, {"role": "assistant", "content": ""})
            for j, piece in enumerate(c.pieces):
                if piece or req.logprobs:
                    yield chunk(i, {"content": piece}, None, logprobs(c, j, j + 1))
            yield chunk(i, {}, c.finish_reason)
        if req.stream_options.get("include_usage"):
            yield {**head, "object": "chat.completion.chunk", "choices": [], "usage": _usage(prompt, choices)}
    return _stream(chunks())


@router.post("/completions")
@_openai_errors
async def completions(request: Request):
    gw, caller = gateway_of(request), caller_of(request)
    req = CompletionRequest.model_validate(await _body(request))
    req.refuse_unsupported()
    if req.echo or req.suffix:
        raise OaiError("echo and suffix are not supported by this server", param="echo" if req.echo else "suffix")
    tok = await tokenizer_of(gw)
    prompt = tok.encode(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)
    request_id, reply = await _sample(gw, caller, prompt, req, req.max_tokens or None,
                                      req.logprobs or 0)
    choices = _choices(tok, reply, req.stop)
    head = {"id": f"cmpl-{request_id}", "object": "text_completion", "created": int(time.time()),
            "model": req.model}
    want_logprobs = req.logprobs is not None

    if not req.stream:
        return {**head, "usage": _usage(prompt, choices), "choices": [
            {"index": i, "text": c.text, "logprobs": _completion_logprobs(tok, c) if want_logprobs else None,
             "finish_reason": c.finish_reason} for i, c in enumerate(choices)]}

    def chunks():
        for i, c in enumerate(choices):
            offset = 0
            for j, piece in enumerate(c.pieces):
                if piece or want_logprobs:
                    lp = _completion_logprobs(tok, c, j, j + 1, offset) if want_logprobs else None
                    yield {**head, "choices": [{"index": i, "text": piece, "logprobs": lp, "finish_reason": None}]}
                offset += len(piece)
            yield {**head, "choices": [{"index": i, "text": "", "logprobs": None, "finish_reason": c.finish_reason}]}
        if req.stream_options.get("include_usage"):
            yield {**head, "choices": [], "usage": _usage(prompt, choices)}
    return _stream(chunks())
