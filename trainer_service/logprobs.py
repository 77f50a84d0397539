"""log p(target) of every token of a batch, without the batch's full logits where the model allows.

The plain way (a CausalLM's forward, then a cross-entropy over [batch, longest, vocabulary]
logits) computes the unembedding for padding too, and holds fp32 logits of the whole batch,
plus their gradient in the backward: 8 x 512 tokens x a 49,152-token vocabulary is 805 MB, x
128,256 2.1 GB. For the model types whose CausalLM forward is just `lm_head(model(...))`:
- only the real positions (not the padding) go through lm_head;
- when their logits would exceed `max_logits_bytes`, they go in chunks, each chunk's logits
  recomputed in the backward instead of kept (torch.utils.checkpoint): memory bounded by one
  chunk, for one more lm_head forward per chunk. Under ZeRO-3 the parameters are gathered only
  during the module's forward, so there the chunks are kept, not recomputed.
Each position's value is the same either way: the same lm_head row product and a log-softmax
over its own row.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

# CausalLM forwards that are exactly lm_head(hidden) (no soft-capping or logit scale, as Gemma 2/3
# and Cohere have): their hidden states may be unembedded here, position by position.
PLAIN_HEADS = frozenset({"llama", "mistral", "qwen2", "qwen3"})
DEFAULT_MAX_LOGITS_BYTES = 1 << 30
# On a GPU, the whole batch's logits up to this share of the activation budget (a quarter of the
# card): chunking costs one more lm_head forward, which a GPU step shows (docs/benchmarks.md#in-the-trainer).
GPU_LOGITS_SHARE = 8


def default_logits_bytes(device_type: str, activation_budget: int) -> int:
    """--max-logits-mib 0: 1 GiB on a CPU (host memory is what the whole stack shares); on a GPU
    an eighth of the activation budget, at least 1 GiB (fp32 logits, their gradient and the 16-bit
    logits add about 2.5 times it to the step's peak)."""
    if device_type != "cuda":
        return DEFAULT_MAX_LOGITS_BYTES
    return max(DEFAULT_MAX_LOGITS_BYTES, activation_budget // GPU_LOGITS_SHARE)


def _of_logits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) of each row of [positions, vocabulary] logits, in fp32."""
    if logits.dtype != torch.float32:
        logits = logits.float()
    return -torch.nn.functional.cross_entropy(logits, targets, reduction="none")


def _lp(lm_head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return _of_logits(lm_head(hidden), targets)


def _real_rows(per_position: torch.Tensor, targets: torch.Tensor,
               real: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """[batch, longest, ...] and its targets as rows of the real positions only (found on the
    host: no device sync). 1-D `targets` are already one per entry of `real` (a packed batch's)."""
    rows = per_position.flatten(0, 1)
    if targets.dim() == 1:
        return rows.index_select(0, real), targets
    wanted = targets.flatten()
    if real is None:
        return rows, wanted
    return rows.index_select(0, real), wanted.index_select(0, real)


def token_logprobs(causal_lm: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                   targets: torch.Tensor, real: torch.Tensor | None = None, *,
                   position_ids: torch.Tensor | None = None, expand: torch.Tensor | None = None,
                   paths: list | None = None, max_logits_bytes: int = DEFAULT_MAX_LOGITS_BYTES,
                   recompute: bool = True) -> torch.Tensor:
    """The fp32 log-probabilities of the real tokens' `targets`, flat, datum after datum.
    `causal_lm`: the transformers CausalLM (PEFT's layers in it); `real`: the flat positions of
    the real tokens in [batch, longest] (None: every position); `recompute`: chunks may be
    recomputed in the backward (not under ZeRO-3). A batch packed as token trees
    (prefix_tree.py) also gives `position_ids`, a 4-D mask and the `paths` its attention runs on;
    its `real` are the distinct (position, target) pairs to unembed, `targets` theirs (1-D), and
    `expand` every datum token's entry among them."""
    if causal_lm.config.model_type not in PLAIN_HEADS:
        logits = causal_lm(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                           use_cache=False).logits
        return _of_logits(*_real_rows(logits, targets, real))
    trees = {} if paths is None else {"tinkerd_paths": paths}       # to prefix_tree.attention
    hidden = causal_lm.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             use_cache=False, **trees).last_hidden_state
    rows, wanted = _real_rows(hidden, targets, real)
    chunk = max(1, max_logits_bytes // (4 * causal_lm.config.vocab_size))
    if rows.shape[0] <= chunk:
        lp = _lp(causal_lm.lm_head, rows, wanted)
    else:
        again = torch.is_grad_enabled() and recompute
        lp = torch.cat([checkpoint(_lp, causal_lm.lm_head, rows[i:i + chunk], wanted[i:i + chunk], use_reentrant=False)
                        if again else _lp(causal_lm.lm_head, rows[i:i + chunk], wanted[i:i + chunk])
                        for i in range(0, rows.shape[0], chunk)])
    return lp if expand is None else lp.index_select(0, expand)
