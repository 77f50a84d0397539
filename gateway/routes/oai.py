"""OpenAI-compatible inference over the base model and any sampler checkpoint, under the prefix
hosted Tinker uses (`/oai/api/v1`): GET /models, POST /chat/completions, POST /completions.

`model` is a base model name (or alias) or a `tinker://<run>/sampler_weights/<name>` path the
caller may read (theirs or published; anyone else's is 404, as everywhere). Each request is a
sample like `asample`'s: the same body checks (gateway/convert.py), the same per-user and server
limits (gateway/identity/limits.py), a "sample" future in the same scheduler (gateway/futures/store.py) whose job
is asample's own (routes/sampling.py), on the same sampler pool. The gateway holds the model's
tokenizer: it renders chat messages with the tokenizer's chat template and decodes the tokens, in
the tokenizer pool (gateway/openai/tokenizer_work.py), never on the event loop; a prompt longer than
`prompt_char_cap` characters is refused before it is encoded. Formats and errors:
gateway/openai/format.py.

Streaming (`stream: true`) sends server-sent events in OpenAI's chunk format ending in
`data: [DONE]`; the sampler's gRPC API returns whole completions, so the chunks (one per
token) are sent once the completion is done, not as the engine makes them.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

from fastapi import APIRouter, Request
from sqlalchemy import select

from gateway import bodies, convert, protocol
from gateway import tinker_wire_pb2 as tw
from gateway.futures.store import new_request_id
from gateway.identity.auth import caller_of
from gateway.identity.caller import Caller
from gateway.jobs.sampling import Sample, SampleOf
from gateway.storage.db import CheckpointRow, Status
from gateway.openai.format import (ChatRequest, Choice, CommonRequest, CompletionRequest, OaiError, TokenTexts,
                                   answer_json, answer_response, chat_logprob, check_logprob_entries,
                                   completion_logprobs, decode_choices, events, json_object, openai_errors, stream,
                                   usage)
from gateway.openai.tokenizer_work import load, pool, prompt_char_cap
from gateway.state import Gateway, gateway_of

router = APIRouter(prefix="/oai/api/v1")
_WAIT_S = 25.0              # one wait on the future; repeated until it finishes

# ---- the model: base or snapshot -------------------------------------------------------------

async def _model(gw: Gateway, caller: Caller, name: str) -> tuple[str, str]:
    """(snapshot_id, snapshot_path) to sample `name`: ("", "") for the base model."""
    if name in gw.settings.model_names:
        return "", ""
    if not name.startswith("tinker://"):
        raise OaiError(f"the model {name!r} does not exist; GET /oai/api/v1/models lists them", 404,
                       param="model", code="model_not_found")
    ckpt = await gw.sessions.readable_checkpoint(caller, name)
    if ckpt.checkpoint_type != "sampler":
        raise OaiError(f"{name!r} is not a sampler checkpoint (save_weights_for_sampler makes one)",
                       param="model")
    return ckpt.snapshot_id, ckpt.snapshot_path


async def tokenizer_of(gw: Gateway, caller: Caller):
    return await pool.run(caller.user_id, load, gw.settings.base_model)


def _check_prompt_chars(gw: Gateway, chars: int, param: str) -> None:
    """Before encoding: longer text cannot fit the context, and encoding it holds the GIL."""
    context = convert.model_limits(gw.settings.base_model, gw.settings.max_model_len).max_model_len
    cap = prompt_char_cap(context)
    if chars > cap:
        raise OaiError(f"the prompt has {chars} characters; this server encodes at most {cap} "
                       f"(8 x its context of {context} tokens)", param=param,
                       code="context_length_exceeded")


# ---- sampling: asample's path ----------------------------------------------------------------

async def _sample(gw: Gateway, caller: Caller, prompt: list[int], req: CommonRequest, max_tokens: int | None,
                  topk: int, logprobs: bool) -> tuple[str, tw.SampleResponse]:
    """One sample request as asample makes it: checked, limited, run as a "sample" future."""
    snapshot_id, snapshot_path = await _model(gw, caller, req.model)
    limits = convert.model_limits(gw.settings.base_model, gw.settings.max_model_len)
    if max_tokens is None:           # OpenAI's default: up to the context
        max_tokens = max(limits.max_model_len - len(prompt), 1)
    if logprobs:
        check_logprob_entries(req.n, max_tokens, topk)
    body = protocol.SampleRequest(
        num_samples=req.n, prompt=protocol.ModelInput(chunks=[protocol.PromptChunk(tokens=prompt)]),
        sampling_params=protocol.SamplingParams(max_tokens=max_tokens, temperature=req.temperature,
                                                top_p=req.top_p, seed=req.seed, stop=req.stop),
        topk_sample_logprobs=topk)
    convert.check_sample(body, limits)
    msg = convert.sample_request(body, snapshot_id, snapshot_path)
    msg.request_id = new_request_id()
    row = await gw.jobs.submit(Sample(msg, of=SampleOf(caller.user_id, "", gw.settings.base_model)), caller,
                               request_id=msg.request_id, admit=gw.limits.admit_sample(caller))  # burst-proof cap
    while (row := await gw.futures.waits.wait(row.request_id, _WAIT_S, caller.user_id)).status == Status.PENDING:
        pass
    if row.status != Status.COMPLETE:
        error = json.loads(row.result)
        raise OaiError(error.get("error", "sampling failed"), 400 if error.get("category") == "user" else 503)
    reply = tw.SampleResponse()
    reply.ParseFromString(row.result)
    return row.request_id, reply


# ---- routes ----------------------------------------------------------------------------------

def _model_card(model_id: str, created: int, owner: str) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": owner}


def _public_names(names: list[str]) -> list[str]:
    """Its aliases, not the server's directory (it still works as a name), unless there is no other."""
    return [n for n in names if not os.path.isabs(n)] or names


def _models(gw: Gateway, caller: Caller) -> list[dict]:
    cards = [_model_card(name, 0, "tinkerd") for name in _public_names(gw.settings.model_names)]
    rows = gw.db.select(select(CheckpointRow).where(CheckpointRow.owner == caller.user_id,
                                                    CheckpointRow.checkpoint_type == "sampler")
                        .order_by(CheckpointRow.created_at))
    return cards + [_model_card(r.tinker_path, int(r.created_at.timestamp()), caller.user_id) for r in rows]


@router.get("/models")
@openai_errors
async def list_models(request: Request):
    """The base model's names and the caller's sampler checkpoints."""
    return {"object": "list", "data": await asyncio.to_thread(_models, gateway_of(request), caller_of(request))}


@router.get("/models/{model:path}")
@openai_errors
async def get_model(request: Request):
    gw, caller, name = gateway_of(request), caller_of(request), request.path_params["model"]
    if name not in gw.settings.model_names:
        row = await gw.sessions.readable_checkpoint(caller, name)
        if row.checkpoint_type != "sampler":
            raise OaiError(f"{name!r} is not a sampler checkpoint", 404, param="model", code="model_not_found")
        owner = row.owner if row.owner == caller.user_id else "tinkerd"   # a published one's is not theirs to learn
        return _model_card(name, int(row.created_at.timestamp()), owner)
    return _model_card(name, 0, "tinkerd")


def _chat_prompt(gw: Gateway, tok, req: ChatRequest) -> list[int]:
    if not tok.chat_template:
        raise OaiError("this model's tokenizer has no chat template; use /completions", param="messages")
    try:
        text = tok.apply_chat_template([{"role": m.role, "content": m.text()} for m in req.messages],
                                       tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - a template may raise anything (jinja's raise_exception) on odd input
        raise OaiError(f"the chat template refused these messages: {e}", param="messages") from None
    _check_prompt_chars(gw, len(text), "messages")
    return tok.encode(text, add_special_tokens=False)


@router.post("/chat/completions")
@openai_errors
async def chat_completions(request: Request):
    gw, caller = gateway_of(request), caller_of(request)
    req = await bodies.model_of(request, ChatRequest, json_object)
    req.refuse_unsupported()
    _check_prompt_chars(gw, sum(len(m.text()) for m in req.messages), "messages")
    tok = await tokenizer_of(gw, caller)
    prompt = await pool.run(caller.user_id, _chat_prompt, gw, tok, req)
    request_id, reply = await _sample(gw, caller, prompt, req, req.max_completion_tokens or req.max_tokens,
                                      req.top_logprobs if req.logprobs else 0, req.logprobs)
    answer = await pool.run(caller.user_id, _chat_answer, tok, req, prompt, request_id, reply)
    return stream(answer) if req.stream else answer_response(answer)


def _chat_answer(tok, req: ChatRequest, prompt: list[int], request_id: str, reply: tw.SampleResponse):
    """The response (or its server-sent events), in a tokenizer thread."""
    choices = decode_choices(tok, reply, req.stop)
    texts = TokenTexts(tok)
    head = {"id": f"chatcmpl-{request_id}", "created": int(time.time()), "model": req.model}

    def logprobs(c: Choice, start: int, end: int):
        if not req.logprobs:
            return None
        return {"content": [chat_logprob(texts, t, lp, k)
                            for t, lp, k in zip(c.tokens[start:end], c.logprobs[start:end], c.topk[start:end])]}

    if not req.stream:
        return answer_json({**head, "object": "chat.completion", "usage": usage(prompt, choices), "choices": [
            {"index": i, "message": {"role": "assistant", "content": c.text}, "logprobs": logprobs(c, 0, None),
             "finish_reason": c.finish_reason} for i, c in enumerate(choices)]})

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
            yield {**head, "object": "chat.completion.chunk", "choices": [], "usage": usage(prompt, choices)}
    return events(chunks())


@router.post("/completions")
@openai_errors
async def completions(request: Request):
    gw, caller = gateway_of(request), caller_of(request)
    req = await bodies.model_of(request, CompletionRequest, json_object)
    req.refuse_unsupported()
    if req.echo or req.suffix:
        raise OaiError("echo and suffix are not supported by this server", param="echo" if req.echo else "suffix")
    if isinstance(req.prompt, str):
        _check_prompt_chars(gw, len(req.prompt), "prompt")
    tok = await tokenizer_of(gw, caller)
    prompt = (await pool.run(caller.user_id, tok.encode, req.prompt) if isinstance(req.prompt, str)
              else list(req.prompt))
    request_id, reply = await _sample(gw, caller, prompt, req, req.max_tokens or None,
                                      req.logprobs or 0, req.logprobs is not None)
    answer = await pool.run(caller.user_id, _completion_answer, tok, req, prompt, request_id, reply)
    return stream(answer) if req.stream else answer_response(answer)


def _completion_answer(tok, req: CompletionRequest, prompt: list[int], request_id: str, reply: tw.SampleResponse):
    """The response (or its server-sent events), in a tokenizer thread."""
    choices = decode_choices(tok, reply, req.stop)
    texts = TokenTexts(tok)
    head = {"id": f"cmpl-{request_id}", "object": "text_completion", "created": int(time.time()),
            "model": req.model}
    want_logprobs = req.logprobs is not None

    if not req.stream:
        return answer_json({**head, "usage": usage(prompt, choices), "choices": [
            {"index": i, "text": c.text, "logprobs": completion_logprobs(texts, c) if want_logprobs else None,
             "finish_reason": c.finish_reason} for i, c in enumerate(choices)]})

    def chunks():
        for i, c in enumerate(choices):
            offset = 0
            for j, piece in enumerate(c.pieces):
                if piece or want_logprobs:
                    lp = completion_logprobs(texts, c, j, j + 1, offset) if want_logprobs else None
                    yield {**head, "choices": [{"index": i, "text": piece, "logprobs": lp, "finish_reason": None}]}
                offset += len(piece)
            yield {**head, "choices": [{"index": i, "text": "", "logprobs": None, "finish_reason": c.finish_reason}]}
        if req.stream_options.get("include_usage"):
            yield {**head, "choices": [], "usage": usage(prompt, choices)}
    return events(chunks())
