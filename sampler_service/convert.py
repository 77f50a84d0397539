"""Sampler gRPC messages <-> vLLM's parameters and results (the only sampler module knowing both)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from tinkerd import dtypes, tensors, weight_stream
from tinkerd.errors import ServiceError, UserError
from tinkerd.v1 import common_pb2, sampler_pb2

_TOPK_PAD_LOGPROB = -99999.0
_Stop = sampler_pb2.SamplingParams.StopMode
# Token ids a prompt position may name in prompt_target_ids: as many as a top-k (vLLM's
# max_logprobs, which also bounds its own scoring of fixed ids).
MAX_TARGETS_PER_POSITION = 20
# The SamplingParams.extra_args entry that carries a request's target ids to the model runner
# (worker_ext.py scores them in the prefill).
PROMPT_TARGETS_ARG = "tinkerd_prompt_targets"


@dataclasses.dataclass(frozen=True)
class PromptTargets:
    """SampleRequest.prompt_target_ids made compact for the engine: row r of `ids` holds the ids
    asked at prompt position start + r + 1, in the request's order, then -1. Rows before `start`
    ask for nothing, so the engine scores from there. `cells` maps each stored value of the
    request (every cell of a dense one) to its place in `ids.flat`, -1 where it asks nothing,
    so the reply comes back in the request's own layout."""
    ids: np.ndarray
    start: int
    cells: np.ndarray
    request: common_pb2.Tensor

    def engine_arg(self) -> dict:
        return {"start": self.start, "width": self.ids.shape[1], "ids": self.ids.tobytes()}

    def reply(self, scores: np.ndarray) -> common_pb2.Tensor:
        """The scores (engine rows from `start`, as `ids`) in the request's layout: float32, 0
        where the request had -1."""
        if scores is None or scores.shape != self.ids.shape:
            raise ServiceError(f"the engine scored prompt targets of shape "
                               f"{None if scores is None else scores.shape}, not {self.ids.shape}")
        asked = self.cells >= 0
        values = np.zeros(len(self.cells), dtype="<f4")
        values[asked] = scores.reshape(-1)[self.cells[asked]]
        if not np.isfinite(values[asked]).all():
            raise ServiceError("the engine left prompt targets unscored")
        out = common_pb2.Tensor(dtype=common_pb2.DTYPE_FLOAT32, shape=list(self.request.shape), data=values.tobytes())
        if self.request.HasField("sparse_csr"):
            out.sparse_csr.CopyFrom(self.request.sparse_csr)
        return out


def prompt_targets(request: sampler_pb2.SampleRequest, vocab_size: int) -> PromptTargets | None:
    """The request's prompt_target_ids, checked (shape, ids in the vocabulary or -1, at least
    one, at most MAX_TARGETS_PER_POSITION a position) and made compact; None if it has none."""
    if not request.HasField("prompt_target_ids"):
        return None
    t, where = request.prompt_target_ids, "target_prompt_logprobs"
    if t.dtype not in (common_pb2.DTYPE_INT64, common_pb2.DTYPE_INT32):
        raise UserError(f"{where} must hold int64 token ids, got {common_pb2.DType.Name(t.dtype)}")
    rows = len(request.prompt_tokens) - 1
    if len(t.shape) != 2 or t.shape[0] != rows:
        raise UserError(f"{where} has shape {list(t.shape)}; a prompt of {len(request.prompt_tokens)} tokens "
                        f"takes [len(prompt) - 1, K] = [{rows}, K]")
    values = np.frombuffer(t.data, dtype=dtypes.by_wire(t.dtype).numpy)
    try:
        if t.HasField("sparse_csr"):
            row_of, _ = tensors.csr_indices(t.sparse_csr.crow_indices, t.sparse_csr.col_indices, len(values),
                                            tuple(t.shape))
        elif len(values) != t.shape[0] * t.shape[1]:
            raise ValueError(f"{len(values)} values do not fill shape {list(t.shape)}")
        else:
            row_of = np.repeat(np.arange(rows), t.shape[1])
    except ValueError as e:
        raise UserError(f"{where}: {e}") from None
    bad = values[(values < -1) | (values >= vocab_size)]
    if len(bad):
        raise UserError(f"{where}: token id {int(bad[0])} is outside the vocabulary [0, {vocab_size}) "
                        f"(-1 asks for nothing)")
    asked = values >= 0
    if not asked.any():
        raise UserError(f"{where} names no token id (every cell is -1)")
    row = row_of[asked]                   # non-decreasing: CSR and row-major orders are by row
    column = np.arange(len(row)) - np.searchsorted(row, row)
    width, start = int(column.max()) + 1, int(row[0])
    if width > MAX_TARGETS_PER_POSITION:
        raise UserError(f"{where} names {width} token ids at one prompt position; at most "
                        f"{MAX_TARGETS_PER_POSITION} (as topk_prompt_logprobs)")
    ids = np.full((rows - start, width), -1, dtype=np.int32)
    ids[row - start, column] = values[asked]
    cells = np.full(len(values), -1, dtype=np.int64)
    cells[asked] = (row - start) * width + column
    return PromptTargets(ids, start, cells, t)


def sampling_params(request: sampler_pb2.SampleRequest, targets: PromptTargets | None = None):
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
    if targets is not None:
        # Every prompt position from `start` must be computed here: none read from the prefix cache.
        kwargs.update(extra_args={PROMPT_TARGETS_ARG: targets.engine_arg()}, skip_reading_prefix_cache=True)
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


def _first_scored(prompt_tokens: list[int], last_n: int) -> int:
    """The first prompt position scored: 1 (position 0 has no context), or the first of the last n."""
    return max(len(prompt_tokens) - last_n, 1) if last_n > 0 else 1


def prompt_logprobs(output, prompt_tokens: list[int], last_n: int) -> list[float]:
    first = _first_scored(prompt_tokens, last_n)
    values = [math.nan] * min(first, len(prompt_tokens))
    for pos in range(first, len(prompt_tokens)):
        row = output.prompt_logprobs[pos] if output.prompt_logprobs else None
        values.append(row[prompt_tokens[pos]].logprob if row else math.nan)
    return values


def sample_response(request: sampler_pb2.SampleRequest, outputs: list,
                    targets: PromptTargets | None = None) -> sampler_pb2.SampleResponse:
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
        scored = _first_scored(tokens, request.prompt_logprobs_last_n)
        rows = [None] * scored + list(first.prompt_logprobs[scored:])
        reply.topk_prompt_logprobs.CopyFrom(_topk(rows, request.topk_prompt_logprobs))
    if targets is not None:
        reply.prompt_target_logprobs.CopyFrom(targets.reply(first.prompt_token_id_logprobs))
    return reply


def tensor_specs(manifest: sampler_pb2.WeightManifest) -> list[weight_stream.TensorSpec]:
    """The packed layout a weight manifest announces."""
    return [weight_stream.TensorSpec(s.name, dtypes.by_wire(s.dtype).name, tuple(s.shape), s.chunk, s.offset)
            for s in manifest.tensors]
