"""Tinker's training calls on a model's DeepSpeed engine.

Every forward_backward is a micro-step *inside* a gradient-accumulation window (the boundary is
held open), so gradients add up across calls; optim_step closes the window with a 1-token
zero-loss micro-step (which triggers ZeRO's reduction), steps, and opens a new window. Losses
are sums, so DeepSpeed's 1/GAS scaling is turned off.

The caller (TrainerEngine) holds the engine lock around forward_backward and optim_step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch

from tinkerd.errors import UserError
from trainer_service.registry import LoraModel


@dataclasses.dataclass
class DatumInput:
    tokens: list[int]
    loss_fn_inputs: dict[str, torch.Tensor]


@dataclasses.dataclass
class AdamParams:
    """Every field given: the API's defaults are applied where requests arrive (gateway/protocol.py)."""
    learning_rate: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_clip_norm: float  # 0: no clipping


def validate(data: list[DatumInput], *, vocab_size: int, max_positions: int) -> None:
    if not data:
        raise UserError("forward_backward needs at least one datum")
    for i, d in enumerate(data):
        n = len(d.tokens)
        if n == 0:
            raise UserError(f"datum {i}: model_input is empty")
        if n > max_positions:
            raise UserError(f"datum {i}: {n} tokens exceed the model's context of {max_positions}")
        bad = [t for t in d.tokens if not 0 <= t < vocab_size]
        if bad:
            raise UserError(f"datum {i}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        for key, t in d.loss_fn_inputs.items():
            if t.dim() == 0 or t.shape[0] != n:
                raise UserError(f"datum {i}: loss_fn_inputs[{key!r}] has shape {list(t.shape)}, "
                                f"expected leading dimension {n} (the number of input tokens)")
        targets = d.loss_fn_inputs.get("target_tokens")
        if targets is None:
            raise UserError(f"datum {i}: loss_fn_inputs needs 'target_tokens'")
        if targets.dim() != 1:
            raise UserError(f"datum {i}: target_tokens must be 1-D, got shape {list(targets.shape)}")
        if ((targets < 0) | (targets >= vocab_size)).any():
            raise UserError(f"datum {i}: a target token is outside the vocabulary [0, {vocab_size})")


def _batch(data: list[DatumInput], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input ids and their attention mask."""
    lengths = [len(d.tokens) for d in data]
    ids = torch.zeros(len(data), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, d in enumerate(data):
        ids[i, :lengths[i]] = torch.tensor(d.tokens)
        mask[i, :lengths[i]] = 1
    return ids.to(device), mask.to(device)


def forward_backward(model: LoraModel, data: list[DatumInput], loss_impl, loss_fn_config: dict[str, float], *,
                     forward_only: bool, device: torch.device, ranks: int = 1):
    """Returns (per-datum outputs, metrics). Gradients accumulate until optim_step.
    With `ranks` > 1, `data` is this rank's share of the batch (ranks.py): DeepSpeed averages
    gradients over ranks and the loss is a sum, so this rank's part is scaled by `ranks`."""
    grad_ctx = torch.no_grad() if forward_only else contextlib.nullcontext()
    if not data:     # a share left empty: the same forward (and backward) collectives as the others
        with grad_ctx:
            empty = _closing_loss(model, 3, device)
        if not forward_only:
            model.engine.backward(empty, scale_wrt_gas=False)
        return [], {"loss:sum": 0.0}
    ids, mask = _batch(data, device)
    with grad_ctx:
        logits = model.engine(ids, mask)
        if logits.dtype != torch.float32:
            logits = logits.float()
        total = logits.new_zeros((), dtype=torch.float32)
        outputs = []
        for i, d in enumerate(data):
            inputs = {k: v.to(device, torch.float32) if v.is_floating_point() else v.to(device)
                      for k, v in d.loss_fn_inputs.items()}
            targets = inputs["target_tokens"].long()
            # log p(target) = -cross_entropy: fused, and no (T, vocab) log-softmax kept for backward
            lp = -torch.nn.functional.cross_entropy(logits[i, :len(d.tokens)], targets, reduction="none")
            per_token = loss_impl(lp, inputs, loss_fn_config)
            total = total + per_token.sum()
            outputs.append({"logprobs": lp.detach().float().cpu(),
                            "elementwise_loss": per_token.detach().float().cpu()})
    if not forward_only:
        model.engine.backward(total * ranks if ranks > 1 else total, scale_wrt_gas=False)
    return outputs, {"loss:sum": float(total.detach())}


def check_adam(adam: AdamParams) -> None:
    """Before the step (the gateway checks too): a NaN, infinite or negative value would be
    applied and leave every weight of the adapter NaN."""
    values = dataclasses.asdict(adam)
    bad = [k for k, v in values.items() if not math.isfinite(v) or v < 0]
    if bad:
        raise UserError(f"invalid Adam parameters: {bad[0]} = {values[bad[0]]} (must be finite and >= 0)")
    if not (adam.beta1 < 1 and adam.beta2 < 1):
        raise UserError(f"invalid Adam parameters: beta1 and beta2 must be < 1, got {adam.beta1}, {adam.beta2}")
    if adam.eps <= 0:
        raise UserError(f"invalid Adam parameters: eps must be > 0, got {adam.eps}")


def optim_step(model: LoraModel, adam: AdamParams, *, zero_stage: int, device: torch.device) -> dict[str, float]:
    engine = model.engine
    for group in engine.optimizer.param_groups:
        group.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                     weight_decay=adam.weight_decay)
    engine.optimizer.clip_grad = adam.grad_clip_norm
    engine.set_gradient_accumulation_boundary(True)
    engine.backward(_closing_loss(model, zero_stage, device), scale_wrt_gas=False)
    engine.step()
    engine.set_gradient_accumulation_boundary(False)
    model.step += 1
    norm = engine.get_global_grad_norm()
    metrics = {"step:max": float(model.step)}
    if norm is not None:
        metrics["grad_norm:mean"] = float(norm)
    return metrics


def _closing_loss(model: LoraModel, zero_stage: int, device: torch.device) -> torch.Tensor:
    """A zero loss whose backward touches every parameter of the model: the micro-step that
    closes the accumulation window and runs ZeRO's reduction. Under ZeRO-1/2 the parameters
    are whole, so a sum over them does it without running the base model; under ZeRO-3 they
    are partitioned and only a forward gathers them, so that takes a 1-token forward."""
    if zero_stage == 3:
        return model.engine(torch.zeros(1, 1, dtype=torch.long, device=device)).sum() * 0.0
    model.engine.module.activate()       # PEFT keeps requires_grad only on the active adapter
    return sum(p.sum() for p in model.params) * 0.0
