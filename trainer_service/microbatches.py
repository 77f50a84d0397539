"""A forward_backward's datums in micro-batches whose saved activations fit a memory budget.

What a batch keeps for its backward grows with its tokens: SmolLM2-135M in fp32 keeps 1.36 MiB a
token, so the cookbook's arithmetic RL batch (128 datums of ~70 tokens) held ~12 GiB at once and
the trainer was OOM-killed on a 24 GiB host (2026-11-27; the SDK's retries hid it as a slow step).
Losses are sums, so the datums may go through forward and backward in groups whose gradients add
up: the same gradient, summed in another order, with the memory of one group.

What a token costs is measured once, at start-up (`measure`): forwards of padded batches
through a scratch adapter of the largest rank on every target module (the costliest adapter
this trainer accepts), counting the tensors autograd keeps for the backward. The fp32 logits of
the models whose head logprobs.py unembeds in chunks are bounded apart (--max-logits-mib); for the
others the probe counts them per token too.
"""

from __future__ import annotations

import dataclasses
import math
import os

import torch

from trainer_service.logprobs import token_logprobs

PROBE_LENGTHS = (64, 256)     # two batch lengths: what a token keeps, and how that grows with the length
# Real batches keep 0-8% more than the probes say (their shapes differ: many short rows, loss
# inputs, the head's chunks; tiny and SmolLM2, 3-256 tokens, tests/trainer/test_microbatches.py).
MARGIN = 1 / 8


@dataclasses.dataclass(frozen=True)
class TokenCost:
    """Bytes autograd keeps per padded token of a micro-batch: `fixed`, plus `per_position` for
    each position of its longest datum (a padded batch's attention mask; an eager attention's
    probabilities grow so too)."""
    fixed: int
    per_position: float

    def of(self, datums: int, longest: int) -> int:
        return int(datums * longest * (self.fixed + self.per_position * longest))

    def tokens_within(self, budget_bytes: int, longest: int) -> int:
        return int(budget_bytes // (self.fixed + self.per_position * longest))


def default_budget_bytes(device: torch.device) -> int:
    """--activation-mib 0: a quarter of the GPU's memory (of its --gpu-memory-fraction share), or a
    sixteenth of the host's (its cgroup limit where lower). A step's peak is about twice its budget over the trainer's resting size
    (the backward's gradients of the activations, the logits' chunk, the allocator's slack:
    SmolLM2 fp32, an RL batch of 128 datums, budget 1 GiB -> +2.3 GiB, 3 GiB -> +6.3 GiB, the
    step as fast), and the host also holds the base model and on one machine the sampler."""
    if device.type == "cuda":
        from tinkerd import hardware
        return hardware.gpu_memory_bytes(device) // 4
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return total // 16


def measure(causal_lm: torch.nn.Module, device: torch.device, *, recompute: bool) -> TokenCost:
    """What autograd keeps per padded token in a forward with the active adapter (the caller makes
    it the costliest one), from two padded batches of two rows (the second half as long: a mask,
    as real batches have): every saved tensor's storage counted once, the weights never.
    `recompute`: as the trainer unembeds (logprobs.py), so that the head counts as it will."""
    weights = {p.untyped_storage().data_ptr() for p in causal_lm.parameters()}
    chunk_bytes = 4 * causal_lm.config.vocab_size * 16      # as a long batch's chunks go
    per_token = []
    for length in PROBE_LENGTHS:
        saved: dict[int, int] = {}

        def keep(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in weights:
                saved[storage.data_ptr()] = storage.nbytes()
            return t

        ids = torch.zeros(2, length, dtype=torch.long, device=device)
        mask = torch.ones(2, length, dtype=torch.long)
        mask[1, length // 2:] = 0
        real = mask.view(-1).nonzero().squeeze(1).to(device)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            token_logprobs(causal_lm, ids, mask.to(device), ids, real, max_logits_bytes=chunk_bytes,
                           recompute=recompute)
        per_token.append(sum(saved.values()) / (2 * length))
    (short, long_), (t_short, t_long) = PROBE_LENGTHS, per_token
    per_position = max(0.0, (t_long - t_short) / (long_ - short))
    fixed = max(t_short - per_position * short, t_long - per_position * long_)
    return TokenCost(fixed=math.ceil(fixed * (1 + MARGIN)), per_position=per_position * (1 + MARGIN))


def plan(lengths: list[int], cost: TokenCost, budget_bytes: int, order: list[int] | None = None) -> list[list[int]]:
    """The datums (indices into `lengths`) in micro-batches, each padded to its longest within
    `budget_bytes`: all in one, in their order, where the batch fits (a forward_backward as it
    always was); else in `order`, by default longest first (which pads least), as many to a group
    as fit. A datum that alone exceeds the budget goes alone."""
    if not lengths:
        return []
    if cost.of(len(lengths), max(lengths)) <= budget_bytes:
        return [list(range(len(lengths)))]
    groups: list[list[int]] = []
    longest = 0
    for i in order if order is not None else sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if groups and cost.of(len(groups[-1]) + 1, max(longest, lengths[i])) <= budget_bytes:
            groups[-1].append(i)
            longest = max(longest, lengths[i])
        else:
            groups.append([i])
            longest = lengths[i]
    return groups
