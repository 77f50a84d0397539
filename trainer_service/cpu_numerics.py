"""A 16-bit base model on CPU rounded the way the sampler's vLLM CPU kernels round it, so the
trainer's logprobs are the sampler's (RL's importance ratios rest on them).

Hooked op by op in bf16, vLLM 0.32's CPU kernels against transformers' modules given vLLM's own
inputs: embeddings, every Linear (oneDNN either way), SiLU*mul, a plain RMSNorm and the logits
agree bit for bit; three ops did not, in every layer, and they drift the two forwards apart
layer by layer (docs/benchmarks.md#in-the-trainer). vLLM rounds once where transformers rounds every step:
- rotary embedding: vLLM's CPU kernel multiplies in fp32 (cos/sin rounded to bf16, the
  cache's dtype) and rounds q and k once; transformers multiplies and adds in bf16.
- attention: vLLM's CPU attention computes in fp32 from bf16 q, k, v and rounds the output
  once (bit for bit PyTorch's fp32 SDPA rounded, but for a rare element on a rounding near-tie);
  bf16 SDPA rounds inside. That is vLLM's vector kernel: on AMX CPUs vLLM would pick its AMX
  kernel, which rounds otherwise, and the sampler keeps the vector one
  (sampler_service/worker_ext.py `_vector_attention`).
- the residual add before each RMSNorm: vLLM's fused add + RMSNorm (the native op on CPU)
  rounds the sum into the bf16 residual but normalizes the fp32 sum; transformers normalizes the
  rounded residual.
And the LoRA delta (after training, the base fix alone still left a gap): PEFT adds
x @ A^T @ B^T * scaling computed in fp32 from the fp32 adapter to the base output and rounds once;
the sampler holds the adapter in bf16 (the push sends the serving dtype), folds the scaling into
B in bf16 (vLLM's LoRALayerWeights.optimize), and its CPU punica ops (grouped_lora.py) shrink in
fp32 into a buffer that the expand rounds to bf16, multiply by B in bf16 and add in bf16.
install() makes the trainer's model do as vLLM's CPU kernels do, per module (nothing global):
the rotary embedding hands out fp32 cos/sin (bf16-rounded values), attention runs in fp32 on q,
k, v rounded to bf16 (its keys padded to whole vectors: `_attention_fp32`), and each decoder
layer's residual adds keep their fp32 sum for the norm that reads it: each of these rounds once,
so it is more precise than before, not less.
install_lora() gives PEFT's LoRA layers the sampler's LoRA arithmetic: bf16 copies of the fp32
adapter weights in the forward, so the gradients reach the fp32 weights through bf16 matmuls
(autocast's mixed precision; before, the LoRA path was fp32 throughout).
With native bf16 and no AMX the trainer's logprobs are then the sampler's at every position,
untrained and trained (bench/bf16_gap.py). On AMX each text alone is equal too (once the sampler
runs its small GEMMs on oneDNN, worker_ext._gemms_on_onednn), but not batched: there oneDNN's
bf16 GEMM sums a row otherwise in calls of over 32 rows, so each side's logprobs move with its
batch (docs/benchmarks.md#bf16_gap). Llama-shaped models were measured; Qwen2, Qwen3 and Mistral
layers are the same code in both libraries (not measured). fp32 models are left alone (every op
is fp32 already: trainer = sampler exactly, as before), and so are GPUs, whose vLLM kernels are
others (not measured).
"""

from __future__ import annotations

import logging
import types

import torch

log = logging.getLogger(__name__)

HALF_DTYPES = (torch.bfloat16, torch.float16)
ATTENTION = "tinkerd_sdpa_fp32"
SUM32 = "_tinkerd_sum32"        # attribute of a residual sum: its fp32 value before rounding
MARK = "_tinkerd_vllm_cpu_numerics"     # on a base model install() changed: its LoRA layers follow

# Decoder layers whose forward is the pre-norm one this module re-implements (input_layernorm,
# self_attn, residual add, post_attention_layernorm, mlp, residual add): read in transformers 5.
# vLLM's implementations of these (llama.py, qwen2.py, qwen3.py) use the fused add-norm the same way.
PRE_NORM_LAYERS = {"LlamaDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer", "MistralDecoderLayer"}
RMS_NORMS = {"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm"}


KEY_MULTIPLE = 16     # fp32 lanes of an AVX-512 vector (two AVX2 vectors)


def _padded_causal_mask(queries: int, keys: int, pad: int, device) -> torch.Tensor:
    """The causal mask of queries that are the last rows of the keys, with `pad` masked key
    columns after them. Cached: every layer of a forward asks for the same one."""
    key = (queries, keys, pad, str(device))
    mask = _CAUSAL_MASKS.get(key)
    if mask is None:
        if len(_CAUSAL_MASKS) > 64:
            _CAUSAL_MASKS.clear()
        mask = torch.ones(queries, keys, dtype=torch.bool, device=device).tril(keys - queries)
        mask = _CAUSAL_MASKS[key] = torch.nn.functional.pad(mask, (0, pad), value=False)
    return mask


_CAUSAL_MASKS: dict = {}


def _attention_fp32(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """SDPA in fp32 on q, k, v rounded to the model's dtype; the output rounded once. (q and k
    arrive in fp32 from the fp32 rotary; so may v: a KV cache takes its dtype from the keys.)

    The keys go padded with masked zeros to a multiple of KEY_MULTIPLE. PyTorch's fp32 CPU
    attention does not sum a row in the same order at every key count (its vectors and a
    shorter tail, by the evidence): a sequence alone (47 keys) and the same sequence padded in a
    batch (57, the last 10 masked) came out a float32 ulp apart, now and then one bf16 step
    after rounding. Where the GEMMs do not move with the batch (AVX512-BF16 without AMX) the
    sampler (vLLM) gives a sequence the same logprobs alone and batched; with whole vectors of
    keys so does the trainer, and they are vLLM's own (docs/benchmarks.md#bf16_gap; on AMX the
    GEMMs move, on both sides).

    SDPA is called here, not through transformers' sdpa_attention_forward: that one repeats the
    key/value heads whenever a mask is passed, where SDPA's own GQA (enable_gqa) computes the
    same output bit for bit without the copies."""
    dtype = module._tinkerd_dtype
    query, key, value = query.to(dtype).float(), key.to(dtype).float(), value.to(dtype).float()
    queries, keys = query.shape[-2], key.shape[-2]
    pad = -keys % KEY_MULTIPLE if dtype in HALF_DTYPES else 0      # fp32 stays PyTorch's own, as before
    if attention_mask is None and (pad or queries != keys):    # plainly causal: is_causal's mask
        attention_mask = _padded_causal_mask(queries, keys, pad, query.device)
    elif pad:
        fill = False if attention_mask.dtype == torch.bool else float("-inf")
        attention_mask = torch.nn.functional.pad(attention_mask, (0, pad), value=fill)
    if pad:
        key = torch.nn.functional.pad(key, (0, 0, 0, pad))
        value = torch.nn.functional.pad(value, (0, 0, 0, pad))
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
        is_causal=bool(causal and attention_mask is None and queries > 1),
        enable_gqa=query.shape[-3] != key.shape[-3])
    return out.transpose(1, 2).contiguous().to(dtype), None


def _register_attention() -> None:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if ATTENTION not in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS.register(ATTENTION, _attention_fp32)
        ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)


def _rotary_fp32(self, x, position_ids):
    """cos/sin as the model's dtype rounds them (vLLM's cache holds them so), handed out as fp32:
    q * cos + rotate_half(q) * sin then runs in fp32 and the attention rounds q and k once."""
    cos, sin = type(self).forward(self, x, position_ids)
    return cos.float(), sin.float()


def _add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a + b rounded to a's dtype (what `a + b` gives), carrying its fp32 value for the next norm."""
    total = a.float() + b.float()
    out = total.to(a.dtype)
    setattr(out, SUM32, total)
    return out


def _norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """transformers' RMSNorm, normalizing the fp32 sum when its input is a residual sum (_add)."""
    x = getattr(hidden_states, SUM32, None)
    if x is None:
        x = hidden_states.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * x.to(hidden_states.dtype)


def _layer_forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                   use_cache=False, position_embeddings=None, **kwargs):
    """transformers' pre-norm decoder layer (LlamaDecoderLayer.forward) with _add for its residual adds."""
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                      position_ids=position_ids, past_key_values=past_key_values,
                                      use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
    hidden_states = _add(residual, hidden_states)
    residual = hidden_states
    hidden_states = self.post_attention_layernorm(hidden_states)
    hidden_states = self.mlp(hidden_states)
    return _add(residual, hidden_states)


def supported(model: torch.nn.Module) -> bool:
    """A causal LM of the pre-norm families above, built with SDPA attention."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    return (layers is not None and len(layers) > 0
            and all(type(layer).__name__ in PRE_NORM_LAYERS for layer in layers)
            and type(getattr(inner, "norm", None)).__name__ in RMS_NORMS
            and hasattr(inner, "rotary_emb")
            and getattr(model.config, "_attn_implementation", None) in ("sdpa", ATTENTION))


def install(model: torch.nn.Module) -> bool:
    """Rounds `model` (an unwrapped transformers causal LM) as vLLM's CPU kernels do; False, and
    nothing changed, for an architecture this does not know."""
    if not supported(model):
        log.warning("%s: trainer and sampler bf16 logprobs will differ by the kernels' rounding "
                    "(cpu_numerics knows Llama, Mistral, Qwen2 and Qwen3 decoder layers with SDPA)",
                    type(model).__name__)
        return False
    _register_attention()
    model.set_attn_implementation(ATTENTION)
    inner = model.model
    inner.rotary_emb.forward = types.MethodType(_rotary_fp32, inner.rotary_emb)
    for layer in inner.layers:
        layer.self_attn._tinkerd_dtype = model.dtype
        layer.forward = types.MethodType(_layer_forward, layer)
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.forward = types.MethodType(_norm_forward, norm)
    inner.norm.forward = types.MethodType(_norm_forward, inner.norm)
    setattr(model, MARK, True)
    return True


def _lora_forward(self, x, *args, **kwargs):
    """PEFT's lora.Linear forward for its one active adapter, computed as vLLM's CPU LoRA path
    computes it (see above): base + ((x @ A^T in fp32, rounded) @ (B * scaling in bf16)^T), in
    the base layer's dtype. Anything but a plain adapter (lora.plain_adapter) takes PEFT's own
    forward."""
    from trainer_service.lora import plain_adapter

    name = plain_adapter(self, args, kwargs)
    if name is None:
        return type(self).forward(self, x, *args, **kwargs)
    result = self.base_layer(x)
    dtype = result.dtype
    a = self.lora_A[name].weight.to(dtype)
    b = self.lora_B[name].weight.to(dtype)
    scaling = self.scaling[name]
    if scaling != 1:
        b = b * scaling
    h = torch.nn.functional.linear(x.float(), a.float()).to(dtype)
    if self._tinkerd_widen:       # no native bf16 GEMM: fp32 operands, one rounding (fp32_gemm.py)
        return result + torch.nn.functional.linear(h.float(), b.float()).to(dtype)
    return result + torch.nn.functional.linear(h, b)


def install_lora(peft_model: torch.nn.Module) -> int:
    """_lora_forward on the LoRA Linear layers of a PEFT model whose base install() changed (the
    ones added since the last call: call it after every add_adapter); returns how many."""
    from tinkerd import hardware
    from trainer_service.lora import install_forward

    if not getattr(peft_model.get_base_model(), MARK, False):
        return 0
    # Without native bf16 math the bf16 matmul by B would take PyTorch's generic loops (its input
    # gradient against lm_head's B has K = vocabulary size): widened instead, as fp32_gemm does.
    widen = not hardware.native_bf16(gpu=False)
    installed = install_forward(peft_model, _lora_forward, HALF_DTYPES)
    for module in installed:
        module._tinkerd_widen = widen
    return len(installed)


def install_where_needed(base: torch.nn.Module) -> bool:
    """install() on a 16-bit base model on CPU (the sampler's vLLM CPU kernels); elsewhere nothing."""
    on_cpu = next(base.parameters()).device.type == "cpu"
    if base.dtype not in HALF_DTYPES or not on_cpu:
        return False
    done = install(base)
    if done:
        log.info("%s on CPU: rotary, attention and residual norms rounded as vLLM's CPU kernels round them",
                 base.dtype)
    return done
