"""Tenant independence (issue 26): a model's losses and adapter weights are bit for bit the same
whether it trains alone on a trainer or interleaved with other tenants of other ranks, batch
sizes, losses and LoRA targets, created before and after it (so it gets another adapter name,
another place in PEFT's layers, and other engines beside its own), in float32.

Why it holds (docs/multi-tenancy.md, "Tenant independence"): every model has its own DeepSpeed
engine and AdamW (no shared optimizer state); a forward_backward batches one model's datums only,
so the kernels see the same shapes whoever else trains; PEFT runs the active adapter only, in
both forward and backward; LoRA dropout is 0 and the PEFT model is in eval mode (no RNG in a
step); the adapter switch (lora.py) only flips which adapter is active and requires grad."""

import pytest
import torch

from trainer_service.engine import AdamParams, DatumInput, TrainerEngine
from trainer_service.lora import LoraSpec

STEPS = 3
A_SPEC = LoraSpec(rank=4, seed=7)


def _adam(lr: float) -> AdamParams:
    return AdamParams(learning_rate=lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01, grad_clip_norm=1.0)


def _sft(tokens: list[int]) -> DatumInput:
    return DatumInput(tokens[:-1], {"target_tokens": torch.tensor(tokens[1:]),
                                    "weights": torch.linspace(0.5, 1.0, len(tokens) - 1)})


def _rl(tokens: list[int], advantage: float) -> DatumInput:
    n = len(tokens) - 1
    return DatumInput(tokens[:-1], {"target_tokens": torch.tensor(tokens[1:]),
                                    "logprobs": torch.full((n,), -6.5), "advantages": torch.full((n,), advantage)})


# A's own batch: two datums of different lengths (so its batch is padded and masked).
A_BATCH = [_sft([5, 6, 7, 8, 9, 10, 11, 12]), _sft([40, 41, 42, 43, 44])]
# The co-tenants': other sizes, lengths and losses.
B_BATCH = [_rl([20 + i, 21, 22 + i, 23, 24, 25, 26 + i, 27, 28], 0.5 - i * 0.25) for i in range(5)]
C_BATCH = [_sft(list(range(100 + i, 130 + i))) for i in range(3)]


def _a_step(engine: TrainerEngine) -> torch.Tensor:
    outputs, _ = engine.forward_backward("A", A_BATCH, "cross_entropy", {}, forward_only=False)
    engine.optim_step("A", _adam(1e-2))
    return torch.cat([torch.cat([o["logprobs"], o["elementwise_loss"]]) for o in outputs])


def _co_tenants_step(engine: TrainerEngine, step: int) -> None:
    engine.forward_backward("B", B_BATCH[:2 + step], "importance_sampling", {}, forward_only=False)
    engine.forward_backward("C", C_BATCH, "cross_entropy", {}, forward_only=True)
    engine.forward_backward("C", C_BATCH[:1], "cross_entropy", {}, forward_only=False)


def _alone(model_dir: str, stage: int) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    engine = TrainerEngine(model_dir, zero_stage=stage)
    engine.create_model("A", A_SPEC)
    losses = [_a_step(engine) for _ in range(STEPS)]
    return losses, engine.export_adapter("A")[0]


def _among_others(model_dir: str, stage: int) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    engine = TrainerEngine(model_dir, zero_stage=stage)
    engine.create_model("B", LoraSpec(rank=16, seed=1))                       # A becomes adapter m1
    engine.create_model("A", A_SPEC)
    engine.create_model("C", LoraSpec(rank=2, seed=3, train_unembed=False, train_attn=False))
    losses = []
    for step in range(STEPS):
        # B and C hold gradients of unfinished steps while A steps, and step in between.
        _co_tenants_step(engine, step)
        losses.append(_a_step(engine))
        engine.optim_step("B", _adam(3e-2))
        if step % 2 == 0:
            engine.optim_step("C", _adam(1e-3))
    return losses, engine.export_adapter("A")[0]


@pytest.mark.parametrize("stage", [2, 3])
def test_a_tenant_trains_bitwise_the_same_alone_and_among_others(tiny_model_dir, stage):
    alone_losses, alone_weights = _alone(tiny_model_dir, stage)
    shared_losses, shared_weights = _among_others(tiny_model_dir, stage)

    for step, (alone, shared) in enumerate(zip(alone_losses, shared_losses)):
        assert torch.equal(alone, shared), f"step {step}: max diff {(alone - shared).abs().max().item()}"
    assert sorted(alone_weights) == sorted(shared_weights)
    differing = [k for k in alone_weights if not torch.equal(alone_weights[k], shared_weights[k])]
    assert not differing, differing[:3]
    # It trained: the weights moved from their init (lora_B starts at zero), the logprobs changed.
    assert any(k.endswith("lora_B.weight") and alone_weights[k].abs().max() > 0 for k in alone_weights)
    assert not torch.equal(alone_losses[0], alone_losses[-1])
