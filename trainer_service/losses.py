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


LOSSES: dict[str, LossFn] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
}


def get_loss(name: str) -> LossFn:
    if name not in LOSSES:
        raise UserError(f"unknown or unsupported loss_fn {name!r}; supported: {sorted(LOSSES)}")
    return LOSSES[name]
