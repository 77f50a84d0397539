"""Switching the active adapter (trainer_service/lora.py): after the first full PEFT set_adapter,
only the adapter that was active and the new one change. The state that leaves must be exactly
the one PEFT's own set_adapter makes: which adapter each layer runs, and which parameters
require grad (the optimizer and ZeRO see only those)."""

from __future__ import annotations

import torch
from peft.tuners.tuners_utils import BaseTunerLayer

from trainer_service.engine import TrainerEngine
from trainer_service.lora import LoraSpec


def _state(peft) -> tuple[dict, dict, object]:
    layers = {n: tuple(m.active_adapters) for n, m in peft.named_modules() if isinstance(m, BaseTunerLayer)}
    grads = {n: p.requires_grad for n, p in peft.named_parameters()}
    return layers, grads, peft.base_model.active_adapter


def test_a_fast_switch_leaves_what_peft_set_adapter_does(tiny_model_dir):
    engine = TrainerEngine(tiny_model_dir, zero_stage=2)
    models = [engine.create_model(f"m{i}", LoraSpec(rank=4, seed=i)) for i in range(3)]
    for model in [models[i] for i in (0, 1, 2, 1, 0, 2, 2, 0)]:
        model.engine.module.activate()
        fast = _state(engine.peft)
        engine.peft.base_model.set_adapter(model.adapter_name)      # PEFT's own, walking everything
        assert _state(engine.peft) == fast
        assert sum(p.requires_grad for p in engine.peft.parameters()) == len(list(model.engine.module.parameters()))


def test_steps_round_robin_train_each_adapter_as_alone(tiny_model_dir):
    """Two tenants stepping in turn end with the weights each gets stepping alone."""
    from trainer_service.engine import AdamParams, DatumInput

    data = [DatumInput([5, 6, 7, 8], {"target_tokens": torch.tensor([6, 7, 8, 9]), "weights": torch.ones(4)})]
    adam = AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.0, grad_clip_norm=0.0)

    def train(engine, model_ids, steps=3):
        for _ in range(steps):
            for model_id in model_ids:
                engine.forward_backward(model_id, data, "cross_entropy", {}, forward_only=False)
                engine.optim_step(model_id, adam)
        return {m: engine.export_adapter(m)[0] for m in model_ids}

    together = TrainerEngine(tiny_model_dir, zero_stage=2)
    alone = TrainerEngine(tiny_model_dir, zero_stage=2)
    for engine in (together, alone):
        for i in range(2):
            engine.create_model(f"t{i}", LoraSpec(rank=4, seed=i))
    both = train(together, ["t0", "t1"])
    solo = {**train(alone, ["t0"]), **train(alone, ["t1"])}
    for model_id in both:
        for name, tensor in both[model_id].items():
            assert torch.equal(tensor, solo[model_id][name]), (model_id, name)
