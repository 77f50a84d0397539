"""TrainerEngine on a real DeepSpeed engine (gloo, one process): Tinker's accumulate-then-step
semantics and tenant isolation, under ZeRO-2 and ZeRO-3."""

import pytest
import torch

from trainer_service.engine import AdamParams, DatumInput, TrainerEngine
from trainer_service.lora import LoraSpec


def _datum(tokens):
    return DatumInput(tokens[:-1], {"target_tokens": torch.tensor(tokens[1:]),
                                    "weights": torch.ones(len(tokens) - 1)})


A = _datum([5, 6, 7, 8, 9, 10, 11, 12])
B = _datum([20, 21, 22, 23, 24, 25])


def _adapter(engine, model_id):
    tensors, _ = engine.export_adapter(model_id)
    return tensors


@pytest.mark.parametrize("stage", [2, 3])
def test_two_calls_accumulate_like_one_and_tenants_stay_apart(tiny_model_dir, stage):
    engine = TrainerEngine(tiny_model_dir, zero_stage=stage)
    for model_id in ("split", "joint", "bystander"):
        engine.create_model(model_id, LoraSpec(rank=4, seed=0))
    untouched = _adapter(engine, "bystander")

    engine.forward_backward("split", [A], "cross_entropy", {}, forward_only=False)
    engine.forward_backward("bystander", [B], "cross_entropy", {}, forward_only=True)
    engine.forward_backward("split", [B], "cross_entropy", {}, forward_only=False)
    engine.forward_backward("joint", [A, B], "cross_entropy", {}, forward_only=False)
    adam = AdamParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=1.0)
    metrics = engine.optim_step("split", adam)
    engine.optim_step("joint", adam)
    assert metrics["step:max"] == 1.0 and metrics["grad_norm:mean"] > 0

    split, joint = _adapter(engine, "split"), _adapter(engine, "joint")
    assert max((split[k] - joint[k]).abs().max().item() for k in split) < 1e-5
    assert max((split[k] - untouched[k]).abs().max().item() for k in split) > 1e-3
    after = _adapter(engine, "bystander")
    assert all(torch.equal(after[k], untouched[k]) for k in after)


def test_bad_inputs_are_user_errors(tiny_model_dir):
    from tinkerd.errors import NotFoundError, UserError

    engine = TrainerEngine(tiny_model_dir, zero_stage=2)
    engine.create_model("m", LoraSpec(rank=2, seed=0))
    with pytest.raises(UserError, match="vocabulary"):
        engine.forward_backward("m", [_datum([1, 2, 10**7])], "cross_entropy", {}, forward_only=True)
    with pytest.raises(NotFoundError):
        engine.forward_backward("nope", [A], "cross_entropy", {}, forward_only=True)
    with pytest.raises(UserError, match="rank"):
        engine.create_model("big", LoraSpec(rank=10**4, seed=0))
