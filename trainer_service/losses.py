"""Tinker loss functions as pure tensor functions.

Each takes the learner's per-token logprobs `lp` of the target tokens (shape (T,), one datum)
plus that datum's loss inputs and config, and returns the per-token loss (T,). The total loss
is the sum over tokens and datums (Tinker's convention: a sum, not a mean).
"""

from __future__ import annotations

from typing import Callable

import torch

from tinkerd.errors import UserError

LossFn = Callable[[torch.Tensor, dict[str, torch.Tensor], dict[str, float]], torch.Tensor]


def _require(inputs: dict[str, torch.Tensor], *names: str) -> list[torch.Tensor]:
    missing = [n for n in names if n not in inputs]
    if missing:
        raise UserError(f"loss_fn_inputs is missing {missing} (got {sorted(inputs)})")
    return [inputs[n] for n in names]


def cross_entropy(lp, inputs, config):
    weights = inputs.get("weights")
    if weights is None:
        weights = torch.ones_like(lp)
    return -lp * weights


def importance_sampling(lp, inputs, config):
    q, adv = _require(inputs, "logprobs", "advantages")
    ratio = torch.exp(lp - q)
    return -ratio * adv


def ppo(lp, inputs, config):
    q, adv = _require(inputs, "logprobs", "advantages")
    lo = config.get("clip_low_threshold", 0.8)
    hi = config.get("clip_high_threshold", 1.2)
    ratio = torch.exp(lp - q)
    return -torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv)


def cispo(lp, inputs, config):
    q, adv = _require(inputs, "logprobs", "advantages")
    lo = config.get("clip_low_threshold", 0.8)
    hi = config.get("clip_high_threshold", 1.2)
    ratio = torch.exp(lp - q).clamp(lo, hi).detach()
    return -ratio * lp * adv


def dro(lp, inputs, config):
    q, adv = _require(inputs, "logprobs", "advantages")
    beta = config.get("beta", 0.05)
    return -(lp * adv - 0.5 * beta * (lp - q) ** 2)


def _sequence_mask(inputs, q, adv) -> torch.Tensor:
    """The datum's sampled tokens: `sequence_ratio_mask` if sent, else where the sampler's logprob
    or the advantage is set (prompt positions carry zeros for both in Tinker's RL data)."""
    mask = inputs.get("sequence_ratio_mask")
    if mask is not None:
        return (mask != 0).to(q.dtype)
    return ((q != 0) | (adv != 0)).to(q.dtype)


def gspo(lp, inputs, config):
    """Group Sequence Policy Optimization (Zheng et al. 2025), token form: one importance ratio per
    sequence, s = exp(mean over sampled tokens of (lp - q)), clipped PPO-style; each token carries
    s * exp(lp - sg(lp)) so the gradient is s * A * mean of the tokens' grad lp. Summed over the
    tokens the loss is the sequence's -min(s A, clip(s) A). Defaults: the paper's clip range."""
    q, adv = _require(inputs, "logprobs", "advantages")
    lo = config.get("clip_low_threshold", 1 - 3e-4)
    hi = config.get("clip_high_threshold", 1 + 4e-4)
    mask = _sequence_mask(inputs, q, adv)
    n = mask.sum().clamp(min=1)
    s = torch.exp(((lp - q) * mask).sum() / n)
    s_tok = s.detach() * torch.exp(lp - lp.detach())
    return -torch.minimum(s_tok * adv, s_tok.clamp(lo, hi) * adv) * mask / n


def stable_reinforce(lp, inputs, config):
    """REINFORCE with a truncated, stop-gradient importance weight: -sg(min(r, C)) * lp * A with
    r = exp(lp - q), C = `truncation` (default 2.0). Tinker's own stable_reinforce is not public;
    this is the standard stable off-policy REINFORCE correction (truncated importance sampling).
    Through the gateway, q at sampled positions is the sampler's recorded logprob, found by the
    datum's provenance spans (gateway/stability.py), not the client's copy."""
    q, adv = _require(inputs, "logprobs", "advantages")
    cap = config.get("truncation", 2.0)
    weight = torch.exp(lp - q).clamp(max=cap).detach()
    return -weight * lp * adv


LOSSES: dict[str, LossFn] = {
    "gspo": gspo,
    "stable_reinforce": stable_reinforce,
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
}


# Per-token losses: each token's loss depends on that token's inputs only, so one call over the
# whole batch's tokens gives each token what a call per datum would (gspo's ratio is per sequence).
ELEMENTWISE = frozenset({cross_entropy, importance_sampling, ppo, cispo, dro, stable_reinforce})


def get_loss(name: str) -> LossFn:
    if name not in LOSSES:
        raise UserError(f"unknown or unsupported loss_fn {name!r}; supported: {sorted(LOSSES)}")
    return LOSSES[name]
