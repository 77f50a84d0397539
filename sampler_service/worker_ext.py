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
"""

from __future__ import annotations

import contextlib
import functools

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


def _per_token_prompt_logits(model_runner) -> None:
    original = model_runner._get_prompt_logprobs_dict

    @functools.wraps(original)
    def patched(hidden_states: torch.Tensor, num_scheduled_tokens):
        lora_manager = getattr(model_runner, "lora_manager", None)
        if lora_manager is None:
            return original(hidden_states, num_scheduled_tokens)
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
            return original(hidden_states, num_scheduled_tokens)
        finally:
            del model.compute_logits

    model_runner._get_prompt_logprobs_dict = patched


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

    def tinkerd_install_lora_fixes(self) -> bool:
        from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

        runner = self.model_runner
        if getattr(runner, "_tinkerd_fixed", False) or getattr(runner, "lora_manager", None) is None:
            return False
        _per_token_prompt_logits(runner)
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
