"""OpenAI's API formats, for routes/oai.py: request bodies (bounded and checked like the Tinker
API's, gateway/protocol.py), sampled tokens decoded to text pieces and logprobs, responses and
server-sent events, and errors in OpenAI's shape `{"error": {"message", "type", "param", "code"}}`
(4xx for what the caller can fix, 429 with Retry-After over a limit)."""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Literal

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field, ValidationError, field_validator

from gateway import protocol
from gateway import tinker_wire_pb2 as tw
from gateway.errors import _field_errors
from gateway.identity.limits import OverLimit
from tinkerd.errors import NotFoundError, UserError

MAX_N = 128                 # OpenAI's own bound on `n`
MAX_LOGPROBS = protocol.MAX_TOPK_LOGPROBS
# Logprob entries one request may ask for: n x max_tokens x (top alternatives + the token). Each
# costs a few microseconds of decoding and about 60 bytes of JSON; this bounds both (about 0.6 s
# of a tokenizer thread, 15 MB) where n=128 x 1024 tokens x top-20 would be 2.8M.
MAX_LOGPROB_ENTRIES = 1 << 18

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


def openai_errors(route):
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


def json_object(raw: bytes) -> dict:
    """A body as a JSON object, or OpenAI's error (gateway/bodies.py reads it off the loop)."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise OaiError(f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise OaiError("the body must be a JSON object")
    return body


# ---- request bodies ------------------------------------------------------------------------

class CommonRequest(protocol.Request):
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


class ChatRequest(CommonRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=protocol.INT32)
    logprobs: bool = False
    top_logprobs: int = Field(0, ge=0, le=MAX_LOGPROBS)


class CompletionRequest(CommonRequest):
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


# A decode window (the last emitted piece's tokens and those not emitted yet) never holds more:
# a character spans at most 4 byte tokens, so real text stays under 8. Only invalid UTF-8 (a
# U+FFFD that never resolves) or tokens that decode to nothing reach it; the window then moves on
# anyway, which keeps decoding linear in the tokens (the text stays the tokenizer's, up to where
# those U+FFFD fall).
_WINDOW = 16


def _skipped_ids(tok) -> frozenset[int]:
    """The ids decode(skip_special_tokens=True) drops: the tokenizer's special added tokens."""
    return frozenset(i for i, t in tok.backend_tokenizer.get_added_tokens_decoder().items() if t.special)


def _pieces(tok, tokens: list[int]) -> list[str]:
    """Each token's share of the decoded text, decoding a few tokens at a time (a character can
    span tokens: its bytes show up with the token that completes it). Special tokens add nothing
    (decoding skips them), so they stay out of the windows."""
    skipped = _skipped_ids(tok)
    pieces = [""] * len(tokens)
    kept = [i for i, t in enumerate(tokens) if t not in skipped]
    ids = [tokens[i] for i in kept]

    def decode(start: int, end: int) -> str:
        return tok.decode(ids[start:end], skip_special_tokens=True)

    prefix = read = 0
    before = ""                                 # decode(prefix, read)
    for j in range(len(ids)):
        after = decode(prefix, j + 1)
        if (len(after) > len(before) and not after.endswith("\ufffd")) or j + 1 - prefix >= _WINDOW:
            pieces[kept[j]] = after[len(before):]
            prefix, read = read, j + 1
            before = decode(prefix, read)
    if read < len(ids):                         # an unfinished character at the end: as the tokenizer decodes it
        pieces[-1] = decode(prefix, len(ids))[len(before):]
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


def decode_choices(tok, reply: tw.SampleResponse, stop) -> list[Choice]:
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


def check_logprob_entries(n: int, max_tokens: int, topk: int) -> None:
    entries = n * max_tokens * (topk + 1)
    if entries > MAX_LOGPROB_ENTRIES:
        raise OaiError(f"n x max_tokens x (top logprobs + 1) = {n} x {max_tokens} x {topk + 1} = {entries} logprob "
                       f"entries; this server returns at most {MAX_LOGPROB_ENTRIES} per request: ask for fewer "
                       f"choices, tokens or top logprobs", param="logprobs")


class TokenTexts:
    """Each token's own text, decoded once per request (the top alternatives repeat a lot)."""

    def __init__(self, tok):
        self.tok, self._texts = tok, {}

    def __call__(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self.tok.decode([token])
        return text


def chat_logprob(texts: TokenTexts, token: int, logprob: float, topk: list[tuple[int, float]]) -> dict:
    text = texts(token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode()),
            "top_logprobs": [{"token": (t := texts(i)), "logprob": lp, "bytes": list(t.encode())}
                             for i, lp in topk]}


def completion_logprobs(texts: TokenTexts, c: Choice, start: int = 0, end: int | None = None,
                        offset: int = 0) -> dict:
    """The legacy completions logprobs object for tokens [start, end) of a choice."""
    end = len(c.tokens) if end is None else end
    tokens = [texts(t) for t in c.tokens[start:end]]
    offsets = list(np.cumsum([offset] + [len(p) for p in c.pieces[start:end]])[:-1].tolist())
    return {"tokens": tokens, "token_logprobs": c.logprobs[start:end],
            "top_logprobs": [{texts(i): lp for i, lp in k} for k in c.topk[start:end]],
            "text_offset": offsets}


def usage(prompt: list[int], choices: list[Choice]) -> dict:
    completion = sum(len(c.tokens) for c in choices)
    return {"prompt_tokens": len(prompt), "completion_tokens": completion, "total_tokens": len(prompt) + completion}


def answer_json(answer: dict) -> bytes:
    """A response body made in a tokenizer thread: FastAPI would otherwise walk it on the loop."""
    return json.dumps(answer).encode()


def answer_response(body: bytes) -> Response:
    return Response(body, media_type="application/json")


def events(chunks) -> list[bytes]:
    """The server-sent events of `chunks`, ending in [DONE]: made whole in a tokenizer thread (the
    completion is finished before the first is sent), so the loop only writes them."""
    return [*(b"data: " + json.dumps(chunk).encode() + b"\n\n" for chunk in chunks), b"data: [DONE]\n\n"]


def stream(sse: list[bytes]) -> StreamingResponse:
    async def send():
        for event in sse:
            yield event
    return StreamingResponse(send(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
