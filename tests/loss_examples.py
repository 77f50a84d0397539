"""Custom losses as users write them for `ServiceClient.create_custom_loss` /
`forward_backward_custom`: the same functions drive the SDK end to end
(tests/e2e/test_custom_loss.py) and the trainer's engine (tests/trainer/test_custom_loss_engine.py)."""

import torch
import torch.nn.functional as F


def dpo_loss(logprobs, ref_logprobs, sign):
    """Per datum: the chosen (sign 1) or rejected (sign -1) side of a DPO pair's log-ratio."""
    margin = sign * (logprobs.sum() - ref_logprobs.sum())
    loss = -F.logsigmoid(0.5 * margin)
    return loss, {"custom/margin:mean": margin.detach(), "custom/dpo:sum": loss}


def ppo_loss(logprobs, old_logprobs, advantages):
    ratio = torch.exp(logprobs - old_logprobs)
    loss = -torch.minimum(ratio * advantages, torch.clamp(ratio, 0.9, 1.1) * advantages).sum()
    return loss, {"custom/ratio:mean": ratio.mean()}
