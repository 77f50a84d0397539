"""A forward_backward's cost in ops does not grow by a few dozen per datum: an RL batch has 100+
short datums, and on a GPU each op is a kernel launch. The batch is built, checked and (for the
per-token losses) scored in a few ops whatever its number of datums, with the same results."""

import pytest
import torch

from trainer_service.engine import DatumInput, TrainerEngine
from trainer_service.losses import LOSSES
from trainer_service.lora import LoraSpec


def _rl_batch(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 40, (n,), generator=gen).tolist()
    return [DatumInput(torch.randint(0, 1000, (m,), generator=gen).tolist(),
                       {"target_tokens": torch.randint(0, 1000, (m,), generator=gen),
                        "logprobs": -5 * torch.rand(m, generator=gen), "advantages": torch.randn(m, generator=gen)})
            for m in lengths]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    engine = TrainerEngine(tiny_model_dir, zero_stage=2)
    engine.create_model("m", LoraSpec(rank=4, seed=0))
    return engine


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo", "cross_entropy"])
def test_per_token_losses_over_the_batch_are_each_datum_s(engine, loss_fn):
    data = _rl_batch(16)
    outputs, metrics = engine.forward_backward("m", data, loss_fn, {}, forward_only=True)
    for d, out in zip(data, outputs):
        inputs = {k: v.float() if v.is_floating_point() else v for k, v in d.loss_fn_inputs.items()}
        want = LOSSES[loss_fn](out["logprobs"], inputs, {})
        assert torch.allclose(out["elementwise_loss"], want, rtol=1e-6, atol=1e-7)
    total = sum(float(out["elementwise_loss"].double().sum()) for out in outputs)
    assert metrics["loss:sum"] == pytest.approx(total, rel=1e-5)


def _aten_ops(engine, data) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        engine.forward_backward("m", data, "importance_sampling", {}, forward_only=False)
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))


def test_a_batch_s_ops_grow_little_with_its_datums(engine):
    few, many = _rl_batch(8, seed=1), _rl_batch(128, seed=2)
    _aten_ops(engine, few)
    extra = (_aten_ops(engine, many) - _aten_ops(engine, few)) / 120
    # 71 per datum before (a loss call, copies, a check and each slice's backward per datum); ~4 now.
    assert extra < 15, f"{extra:.1f} aten ops per extra datum"


def test_an_out_of_vocabulary_target_names_its_datum(engine):
    from tinkerd.errors import UserError

    data = _rl_batch(6)
    data[4].loss_fn_inputs["target_tokens"][2] = 5000
    with pytest.raises(UserError, match="datum 4: a target token is outside the vocabulary"):
        engine.forward_backward("m", data, "importance_sampling", {}, forward_only=True)
