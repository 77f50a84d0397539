"""Sampler gRPC messages <-> vLLM's parameters and results (the only sampler module knowing both)."""

from __future__ import annotations

import math

from tinkerd import dtypes, weight_stream
from tinkerd.errors import UserError
from tinkerd.v1 import sampler_pb2

_TOPK_PAD_LOGPROB = -99999.0
_Stop = sampler_pb2.SamplingParams.StopMode


def sampling_params(request: sampler_pb2.SampleRequest):
    from vllm import SamplingParams

    p = request.params
    if p.max_tokens < 1:
        raise UserError(f"max_tokens must be at least 1, got {p.max_tokens}")
    if p.temperature < 0:
        raise UserError(f"temperature must be >= 0, got {p.temperature}")
    if not 0 < p.top_p <= 1:
        raise UserError(f"top_p must be in (0, 1], got {p.top_p}")
    prompt_k = None
    if request.prompt_logprobs or request.topk_prompt_logprobs > 0:
        prompt_k = max(request.topk_prompt_logprobs, 0)
    # top_k=1 is greedy: vLLM's top-k keeps every logit equal to the k-th (logits < kth are
    # masked), so a tie for the maximum, common among bf16 logits, was sampled at random and n
    # samples of one top_k=1 request differed (seen in bf16); its greedy
    # path takes the argmax, the same token every time.
    greedy = p.top_k == 1
    kwargs = dict(
        n=1, max_tokens=p.max_tokens, temperature=0.0 if greedy else p.temperature, top_p=p.top_p,
        top_k=0 if greedy or p.top_k <= 0 else p.top_k, seed=p.seed if p.HasField("seed") else None,
        logprobs=max(request.topk_sample_logprobs, 0), prompt_logprobs=prompt_k,
        detokenize=p.stop_mode == _Stop.STOP_MODE_STRINGS,
    )
    if p.stop_mode == _Stop.STOP_MODE_NONE:
        kwargs["ignore_eos"] = True
    elif p.stop_mode == _Stop.STOP_MODE_STRINGS:
        kwargs["stop"] = list(p.stop_strings)
    elif p.stop_mode == _Stop.STOP_MODE_TOKENS:
        kwargs["stop_token_ids"] = list(p.stop_token_ids)
    return SamplingParams(**kwargs)


def _topk(rows: list[dict], k: int) -> sampler_pb2.TopkLogprobs:
    ids, lps = [], []
    for row in rows:
        best = sorted(((v.rank, tid, v.logprob) for tid, v in (row or {}).items() if v.rank is not None
                       and v.rank <= k), key=lambda x: x[0])[:k]
        ids += [tid for _, tid, _ in best] + [0] * (k - len(best))
        lps += [lp for _, _, lp in best] + [_TOPK_PAD_LOGPROB] * (k - len(best))
    return sampler_pb2.TopkLogprobs(k=k, token_ids=ids, logprobs=lps)


def prompt_logprobs(output, prompt_tokens: list[int], last_n: int) -> list[float]:
    values = [math.nan]
    for pos in range(1, len(prompt_tokens)):
        row = output.prompt_logprobs[pos] if output.prompt_logprobs else None
        values.append(row[prompt_tokens[pos]].logprob if row else math.nan)
    if last_n > 0:
        cut = max(len(values) - last_n, 0)
        values = [math.nan] * cut + values[cut:]
    return values


def sample_response(request: sampler_pb2.SampleRequest, outputs: list) -> sampler_pb2.SampleResponse:
    reply = sampler_pb2.SampleResponse()
    k = request.topk_sample_logprobs
    for out in outputs:
        completion = out.outputs[0]
        seq = reply.sequences.add(
            tokens=list(completion.token_ids),
            logprobs=[row[t].logprob for t, row in zip(completion.token_ids, completion.logprobs or [])],
            stop_reason=(sampler_pb2.STOP_REASON_LENGTH if completion.finish_reason == "length"
                         else sampler_pb2.STOP_REASON_STOP))
        if k > 0:
            seq.topk_logprobs.CopyFrom(_topk(completion.logprobs or [], k))
    first = outputs[0]
    tokens = list(request.prompt_tokens)
    if request.prompt_logprobs or request.topk_prompt_logprobs > 0:
        reply.prompt_logprobs.extend(prompt_logprobs(first, tokens, request.prompt_logprobs_last_n))
    if request.topk_prompt_logprobs > 0:
        rows = [None] + list(first.prompt_logprobs[1:])
        reply.topk_prompt_logprobs.CopyFrom(_topk(rows, request.topk_prompt_logprobs))
    return reply


def tensor_specs(manifest: sampler_pb2.WeightManifest) -> list[weight_stream.TensorSpec]:
    """The packed layout a weight manifest announces."""
    return [weight_stream.TensorSpec(s.name, dtypes.by_wire(s.dtype).name, tuple(s.shape), s.chunk, s.offset)
            for s in manifest.tensors]
