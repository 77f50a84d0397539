"""What the trainer refuses or skips on its own (issue 24 M2, L4): a padded batch over
--max-batch-tokens, and an optim_step whose loss or gradients are not finite (not applied, and
the metrics say so)."""

import math

import pytest
import torch

from tinkerd.errors import UserError
from trainer_service.engine import AdamParams, DatumInput, TrainerEngine
from trainer_service.lora import LoraSpec

ADAM = AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.0, grad_clip_norm=0.0)


def _datum(tokens, weight=1.0):
    return DatumInput(tokens[:-1], {"target_tokens": torch.tensor(tokens[1:]),
                                    "weights": torch.full((len(tokens) - 1,), weight)})


def _adapter(engine, model_id):
    tensors, _ = engine.export_adapter(model_id)
    return tensors


def test_a_padded_batch_over_max_batch_tokens_is_refused(tiny_model_dir):
    engine = TrainerEngine(tiny_model_dir, zero_stage=2, max_batch_tokens=20)
    engine.create_model("m", LoraSpec(rank=2, seed=0))
    long, short = _datum(list(range(5, 16))), _datum([5, 6])          # 10 tokens and 1
    engine.forward_backward("m", [long, short], "cross_entropy", {}, forward_only=True)     # 2 x 10
    with pytest.raises(UserError, match=r"3 datums padded to the longest \(10 tokens\) make 30 tokens, over "
                                        r"this trainer's --max-batch-tokens 20"):
        engine.forward_backward("m", [long, short, short], "cross_entropy", {}, forward_only=False)
    assert not engine.get("m").pending_grads


@pytest.mark.parametrize("stage, keep", [(2, False), (2, True), (3, False)],
                         ids=["stage 0", "ZeRO-2", "ZeRO-3"])
def test_a_step_with_a_non_finite_loss_is_skipped_and_said_so(tiny_model_dir, stage, keep):
    engine = TrainerEngine(tiny_model_dir, zero_stage=stage, keep_zero_stage=keep)
    for model_id in ("bad", "twin"):
        engine.create_model(model_id, LoraSpec(rank=4, seed=3))
    before = _adapter(engine, "bad")

    _, fb = engine.forward_backward("bad", [_datum([5, 6, 7, 8], weight=math.inf)], "cross_entropy", {},
                                    forward_only=False)
    assert not math.isfinite(fb["loss:sum"])
    metrics = engine.optim_step("bad", ADAM)
    assert metrics.get("optim_step_skipped:sum") == 1.0 and "grad_norm:mean" not in metrics, metrics
    after = _adapter(engine, "bad")
    assert all(torch.equal(after[k], before[k]) for k in before)

    # Its gradients were dropped and Adam's state left alone: the next step is the twin's first.
    good = [_datum([5, 6, 7, 8, 9, 10])]
    for model_id in ("bad", "twin"):
        engine.forward_backward(model_id, good, "cross_entropy", {}, forward_only=False)
        metrics = engine.optim_step(model_id, ADAM)
        assert "optim_step_skipped:sum" not in metrics and metrics["grad_norm:mean"] > 0
    bad, twin = _adapter(engine, "bad"), _adapter(engine, "twin")
    assert max((bad[k] - twin[k]).abs().max().item() for k in bad) < 1e-6
    assert max((bad[k] - before[k]).abs().max().item() for k in bad) > 1e-4
