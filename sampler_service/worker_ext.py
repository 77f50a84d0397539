"""Runs inside the vLLM worker (named by `worker_extension_cls`): registers LoRA snapshots
from in-memory tensors, so a streamed adapter never touches disk on its way in, and installs
two fixes for vLLM 0.32's multi-LoRA batching that tenants sharing a batch depend on (and, on
CPU, token ranks counted without a compile, `_eager_token_ranks`, and the attention and GEMM
kernels the trainer's bf16 arithmetic matches, `_vector_attention` and `_gemms_on_onednn`).

1. Prompt logprobs with a LoRA on lm_head: `_get_prompt_logprobs_dict` computes the logits of
   a request's prompt tokens with the punica wrapper's *per-request* sampler indices, which do
   not line up with the prompt tokens once two requests share a batch (on CPU an einsum shape
   error, or silently another request's adapter when the lengths happen to match; on a GPU the
   lm_head delta is dropped, vLLM issue #51594). We give each of those calls the per-token
   indices of exactly the tokens it scores (`scoring_tokens`).
2. The PyTorch (CPU) punica ops index the stacked adapter weights with the LoRA slot, and a
   base-model token's slot is -1, which Python indexing turns into the *last* slot: a base
   request batched with adapter requests got some tenant's adapter applied. They also gather a
   whole max-rank matrix per token, so sampling through an adapter cost 2-3x raw vLLM configured
   for just that adapter. We replace them with grouped ops (`grouped_lora.py`: one matmul per
   slot at the adapter's true rank, nothing added for slot -1); and a batch with no adapter at
   all skips the LoRA ops.

Beside the prompt logprobs, the same step scores the token ids a request names at its prompt
positions (target_prompt_logprobs, `_score_prompt_targets`) and hands them out in vLLM's own
field for fixed-id prompt scores, which its V1 model runner leaves empty.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import torch


_PATCHED = ("add_lora_linear", "add_lora_logits", "add_lora_embedding")


def _step(punica) -> tuple[bool, list]:
    """(no adapter token in the batch, its rows grouped by slot): worked out once a step, when
    the wrapper's per-token mapping is written (its version moves), not once per layer."""
    indices = punica.token_lora_indices
    try:
        key = (punica._token_lora_indices._version, len(indices))
    except RuntimeError:          # an inference tensor keeps no version: worked out every call
        key = None
    cached = getattr(punica, "_tinkerd_step", None)
    if cached is None or key is None or cached[0] != key:
        from sampler_service import grouped_lora
        plan = grouped_lora.plan_from_tokens(indices)
        cached = punica._tinkerd_step = (key, all(slot < 0 for slot, _ in plan), plan)
    return cached[1], cached[2]


def patch_cpu_punica_ops() -> None:
    """Our CPU LoRA path in vLLM's punica wrapper: the grouped ops for every op call
    (grouped_lora.py), each LoRA linear layer done whole (`grouped_lora.add_lora_linear`, with the
    rows grouped once a step), and a step whose batch has no adapter token (base-model requests
    only) skipping the LoRA math: on CPU the PyTorch punica ops otherwise cost more than the
    model itself (docs/benchmarks.md#in-the-sampler)."""
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    from sampler_service import grouped_lora

    grouped_lora.install(lora_ops, punica_cpu)    # the sgmv ops call bgmv through lora_ops
    cls = punica_cpu.PunicaWrapperCPU
    if "_tinkerd_originals" in cls.__dict__:
        return
    cls._tinkerd_originals = {name: cls.__dict__.get(name) for name in _PATCHED}
    linear = cls.add_lora_linear

    def add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, *, buffer=None,
                        **kwargs):
        if buffer is not None or len(self.token_lora_indices) != x.shape[0]:
            return linear(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, buffer=buffer,
                          **kwargs)
        grouped_lora.add_lora_linear(y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, _step(self)[1])
    cls.add_lora_linear = functools.wraps(linear)(add_lora_linear)

    for name in _PATCHED:
        apply = getattr(cls, name)

        def skipping(self, *args, _apply=apply, **kwargs):
            if _step(self)[0]:
                return None           # the ops work in place and return None too
            return _apply(self, *args, **kwargs)
        setattr(cls, name, functools.wraps(apply)(skipping))


def unpatch_cpu_punica_ops() -> None:
    """vLLM's own CPU LoRA path back, ops and wrapper methods (a benchmark compares the two in
    one process; patch_cpu_punica_ops puts ours back)."""
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    from sampler_service import grouped_lora

    grouped_lora.uninstall(lora_ops, punica_cpu)
    cls = punica_cpu.PunicaWrapperCPU
    for name, method in cls.__dict__.get("_tinkerd_originals", {}).items():
        if method is None:
            delattr(cls, name)
        else:
            setattr(cls, name, method)
    if "_tinkerd_originals" in cls.__dict__:
        del cls._tinkerd_originals


def _language_punica_wrapper(model_runner):
    wrappers = model_runner.lora_manager._adapter_manager.punica_wrapper_mapping
    from vllm.lora.model_manager import DEFAULT_LANGUAGE_WRAPPER_KEY
    return wrappers.get(DEFAULT_LANGUAGE_WRAPPER_KEY) or next(iter(wrappers.values()))


@contextlib.contextmanager
def scoring_tokens(punica, offset: int, n: int):
    """Within: the logits LoRA maps the batch's tokens offset .. offset + n (one request's prompt
    tokens) each to its own adapter, instead of one entry per sampled sequence. The CPU ops read
    the sampler indices; the GPU (and XPU) Triton kernels read `prompt_mapping_meta`, prepared from
    those indices once per step, so that is prepared from the per-token ones too (vLLM issue
    #51594: on a GPU the lm_head delta was otherwise dropped from prompt logprobs). Restored after."""
    meta = getattr(punica, "prompt_mapping_meta", None)
    saved_len, saved = punica.indices_len[1], punica._sampler_indices[:n].clone()
    punica._sampler_indices[:n].copy_(punica._token_lora_indices[offset:offset + n])
    punica.indices_len[1] = n
    if meta is not None:
        _prepare(meta, punica.sampler_indices)
    try:
        yield
    finally:
        punica._sampler_indices[:n].copy_(saved)
        punica.indices_len[1] = saved_len
        if meta is not None:
            _prepare(meta, punica.sampler_indices)


def _prepare(meta, indices: torch.Tensor) -> None:
    from vllm.utils.gpu_sync_debug import gpu_sync_allowed

    with gpu_sync_allowed():           # as vLLM's own update_metadata prepares it: reads a flag back
        meta.prepare_tensors(indices)


@contextlib.contextmanager
def _per_token_prompt_logits(model_runner, hidden_states: torch.Tensor):
    """Within: the model's compute_logits of a slice of `hidden_states` (a request's prompt
    tokens) maps each token to its own adapter (fix 1 above). Nothing changes without LoRA."""
    if getattr(model_runner, "lora_manager", None) is None:
        yield
        return
    punica = _language_punica_wrapper(model_runner)
    model = model_runner.model
    compute_logits = model.compute_logits

    def per_token(h: torch.Tensor):
        # h is hidden_states[offset : offset + n]: the tokens it scores start at `offset`.
        offset = (h.storage_offset() - hidden_states.storage_offset()) // hidden_states.stride(0)
        with scoring_tokens(punica, offset, h.shape[0]):
            return compute_logits(h)

    model.compute_logits = per_token
    try:
        yield
    finally:
        del model.compute_logits


# Prompt rows whose logits are computed at once when scoring target ids (a row is vocab floats).
_SCORING_ROWS = 1024


@dataclasses.dataclass
class _TargetScores:
    """One request's target ids (convert.PromptTargets, rows from `start`) and their scores so far."""
    ids: torch.Tensor          # int64 [rows, width], -1: nothing asked
    start: int
    scores: torch.Tensor       # float32, NaN until its row is computed
    done: bool = False


def _score_prompt_targets(model_runner, hidden_states: torch.Tensor, num_scheduled_tokens: dict) -> None:
    """The logprobs of each request's target ids at the prompt positions this step computes,
    from the same logits and log-softmax as its prompt logprobs (vLLM's _get_prompt_logprobs_dict
    beside it). A request's scores are complete in the step that finishes its prompt, the step
    whose output the scheduler reports: they go out in that output (`_attach_prompt_scores`)."""
    from sampler_service.convert import PROMPT_TARGETS_ARG

    states: dict[str, _TargetScores] = model_runner.__dict__.setdefault("_tinkerd_targets", {})
    for req_id in [r for r in states if r not in model_runner.requests]:
        del states[req_id]                       # finished or aborted
    for req_id, num_tokens in num_scheduled_tokens.items():
        request = model_runner.requests.get(req_id)
        params = getattr(request, "sampling_params", None)
        spec = (params.extra_args or {}).get(PROMPT_TARGETS_ARG) if params is not None else None
        if spec is None or request.prompt_token_ids is None:
            continue
        state = states.get(req_id)
        if state is None:
            ids = torch.frombuffer(bytearray(spec["ids"]), dtype=torch.int32).view(-1, spec["width"]).long()
            state = states[req_id] = _TargetScores(ids, spec["start"], torch.full(ids.shape, math.nan))
        if state.done:                           # resumed after a preemption: scored already
            continue
        prompt_len = len(request.prompt_token_ids)
        chunk_start = request.num_computed_tokens
        chunk_end = chunk_start + num_tokens
        # Hidden state of prompt position r (it predicts token r + 1) in this step's batch:
        base = int(model_runner.query_start_loc.np[model_runner.input_batch.req_id_to_index[req_id]]) - chunk_start
        lo, hi = max(state.start, chunk_start), min(chunk_end, prompt_len - 1)
        for a in range(lo, hi, _SCORING_ROWS):
            b = min(a + _SCORING_ROWS, hi)
            logprobs = model_runner.sampler.compute_logprobs(
                model_runner.model.compute_logits(hidden_states[base + a:base + b]))
            ids = state.ids[a - state.start:b - state.start]
            state.scores[a - state.start:b - state.start] = (
                logprobs.gather(-1, ids.clamp_min(0).to(logprobs.device)).float().cpu())
        if chunk_end >= prompt_len:
            state.scores.masked_fill_(state.ids < 0, -math.inf)
            model_runner._tinkerd_target_out[req_id] = state.scores
            state.done = True


def _attach_prompt_scores(model_runner) -> None:
    """Target scores finished in a step go out in its ModelRunnerOutput's
    prompt_token_id_logprobs_dict: vLLM's own field for fixed-id prompt scores, which the
    scheduler and output processor carry to RequestOutput.prompt_token_id_logprobs."""
    original = model_runner.sample_tokens

    @functools.wraps(original)
    def sample_tokens(*args, **kwargs):
        result = original(*args, **kwargs)
        if model_runner._tinkerd_target_out:
            output = getattr(result, "_model_runner_output", result)      # an async output wraps it
            output.prompt_token_id_logprobs_dict = {**output.prompt_token_id_logprobs_dict,
                                                    **model_runner._tinkerd_target_out}
            model_runner._tinkerd_target_out = {}
        return result

    model_runner.sample_tokens = sample_tokens


def _install_prompt_scoring(model_runner) -> bool:
    """The V1 model runner's prompt-logprob step, with our per-token LoRA logits (fix 1) and the
    scoring of target ids (target_prompt_logprobs). False: a runner without that step."""
    if getattr(model_runner, "_tinkerd_scoring", False):
        return True
    original = getattr(model_runner, "_get_prompt_logprobs_dict", None)
    if original is None or not hasattr(model_runner, "sample_tokens"):
        return False

    @functools.wraps(original)
    def patched(hidden_states: torch.Tensor, num_scheduled_tokens):
        with _per_token_prompt_logits(model_runner, hidden_states):
            out = original(hidden_states, num_scheduled_tokens)
            _score_prompt_targets(model_runner, hidden_states, num_scheduled_tokens)
        return out

    model_runner._get_prompt_logprobs_dict = patched
    model_runner._tinkerd_target_out = {}
    _attach_prompt_scores(model_runner)
    model_runner._tinkerd_scoring = True
    return True


def _count_greater_or_equal(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """vLLM's `batched_count_greater_than` (a sampled token's rank among the logprobs), eager."""
    return (x >= values).sum(-1)


def _eager_token_ranks() -> None:
    """On CPU, a sampled token's rank is counted eagerly: vLLM compiles that count with inductor
    (to spare a GPU the comparison's copy), on the engine thread at each sampler process's first
    request with logprobs, which it held for seconds (docs/benchmarks.md#in-the-sampler).
    Eager it is one comparison and a sum over the logits: the same integers."""
    from vllm.v1.sample import sampler

    sampler.batched_count_greater_than = _count_greater_or_equal


def _vector_attention(model_runner) -> None:
    """bf16 attention on vLLM's vector CPU kernel where vLLM would pick its AMX one. The vector
    kernel computes in fp32 from bf16 q, k, v and rounds the output once, as the trainer does
    (trainer_service/cpu_numerics.py; only a rare element on a rounding near-tie lands otherwise).
    The AMX kernel rounds otherwise throughout: after training, the trainer's and the sampler's
    logprobs parted through it and were equal through the vector kernel, which samples as fast
    (docs/benchmarks.md#in-the-sampler).
    Called once the engine is built: its warm-up wrote KV blocks in the AMX layout, but every
    request writes the blocks it reads (those dummy runs leave no prefix-cache entries)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder

    for groups in model_runner.attn_groups:
        for group in groups:
            for builder in group.metadata_builders:
                if isinstance(builder, CPUAttentionMetadataBuilder) and builder.isa == "amx":
                    builder.isa = "vec"       # AMX needs blocks of 32 tokens: so does the vector kernel
                    builder._set_isa_to_layers(group.layer_names)


def _gemms_on_onednn() -> None:
    """Every 16-bit Linear on oneDNN, the GEMM the trainer's PyTorch runs on CPU, also those that
    vLLM would run on its SGL AMX kernel (weights under 1 MiB, such as a small model's o_proj).
    On an AMX CPU that kernel sums otherwise: a few elements a layer came out a bf16 step apart,
    and the layers grew that into a logprob gap; on oneDNN the sampler's logprobs equal the
    trainer's at every position, text by text (docs/benchmarks.md#in-the-sampler). Decode-sized
    calls take the same time on either.
    Called at import: the worker imports this module (init_worker) before it loads the model,
    and vLLM picks each layer's kernel as it loads."""
    from vllm.model_executor.layers import utils
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        utils._CPU_SGL_GEMM_MAX_WEIGHT_BYTES = 0     # 16-bit weights only; int8's rule comes first


_gemms_on_onednn()


class SnapshotWorkerExtension:
    def tinkerd_install_cpu_fixes(self) -> bool:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return False
        _eager_token_ranks()
        _vector_attention(self.model_runner)
        return True

    def tinkerd_install_prompt_scoring(self) -> bool:
        return _install_prompt_scoring(self.model_runner)

    def tinkerd_install_lora_fixes(self) -> bool:
        from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

        runner = self.model_runner
        if getattr(runner, "_tinkerd_fixed", False) or getattr(runner, "lora_manager", None) is None:
            return False
        _install_prompt_scoring(runner)
        if isinstance(_language_punica_wrapper(runner), PunicaWrapperCPU):
            patch_cpu_punica_ops()
        runner._tinkerd_fixed = True
        return True

    def tinkerd_add_lora_tensors(self, lora_int_id: int, tensors: dict[str, torch.Tensor],
                                 adapter_config: dict) -> bool:
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        worker_manager = self.model_runner.lora_manager
        manager = worker_manager._adapter_manager
        config = dict(adapter_config)
        config["vllm_max_position_embeddings"] = worker_manager.max_position_embeddings
        helper = PEFTHelper.from_dict(config)
        helper.validate_legal(worker_manager.lora_config)
        mapper = getattr(manager.model, "hf_to_vllm_mapper", None)
        lora = LoRAModel.from_lora_tensors(
            lora_int_id, tensors, helper, device="cpu",
            dtype=worker_manager.lora_config.lora_dtype, model_vocab_size=worker_manager.vocab_size,
            weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
            skip_prefixes=getattr(manager.model, "lora_skip_prefixes", None),
        )
        manager.remove_adapter(lora_int_id)
        if len(manager) + 1 > manager.capacity:
            manager.remove_oldest_adapter()
        return manager.add_adapter(lora)
