"""bf16 training where it is chosen (issue 14): the loss falls in bounded time on the tiny model,
the fp32-GEMM path for CPUs without native bf16 computes what a bf16 GEMM does, and the trainer's
logprobs agree with the bf16 sampler's through the unmodified SDK."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from conftest import assert_reproducible_sampling
from tinkerd import hardware
from trainer_service import fp32_gemm
from trainer_service.engine import AdamParams, DatumInput, TrainerEngine
from trainer_service.lora import LoraSpec

TOKENS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [20, 21, 22, 23, 24, 25, 26, 27]]


def _data():
    return [DatumInput(t[:-1], {"target_tokens": torch.tensor(t[1:]), "weights": torch.ones(len(t) - 1)})
            for t in TOKENS]


def test_widened_linear_computes_a_bf16_gemm():
    """Same output and input gradient as PyTorch's own bf16 Linear, up to bf16 rounding of the result."""
    torch.manual_seed(0)
    native = torch.nn.Linear(48, 80, dtype=torch.bfloat16).requires_grad_(False)
    widened = torch.nn.Linear(48, 80, dtype=torch.bfloat16).requires_grad_(False)
    widened.load_state_dict(native.state_dict())
    assert fp32_gemm.install(widened) == 1
    x = torch.randn(3, 5, 48, dtype=torch.bfloat16)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ya, yb = native(xa), widened(xb)
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb, ya, atol=2e-2, rtol=2e-2)
    grad = torch.randn_like(ya)
    ya.backward(grad)
    yb.backward(grad)
    assert xb.grad.dtype == torch.bfloat16
    torch.testing.assert_close(xb.grad, xa.grad, atol=2e-2, rtol=2e-2)


def test_widening_refuses_trainable_layers():
    with pytest.raises(ValueError, match="frozen"):
        fp32_gemm.install(torch.nn.Linear(4, 4, dtype=torch.bfloat16))


@pytest.mark.serial
def test_bf16_training_loss_falls_in_bounded_time(tiny_model_dir):
    engine = TrainerEngine(tiny_model_dir, zero_stage=2, dtype="bfloat16")
    assert engine.peft.base_model.model.dtype == torch.bfloat16
    widened = [m for m in engine.peft.modules() if getattr(m.forward, "__func__", None) is fp32_gemm._widened_forward]
    assert bool(widened) == (not hardware.native_bf16(gpu=False)) or torch.cuda.is_available()
    engine.create_model("m", LoraSpec(rank=8, seed=0))
    adam = AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.0, grad_clip_norm=0.0)
    losses = []
    t0 = time.monotonic()
    for _ in range(5):
        _, metrics = engine.forward_backward("m", _data(), "cross_entropy", {}, forward_only=False)
        engine.optim_step("m", adam)
        losses.append(metrics["loss:sum"])
    elapsed = time.monotonic() - t0
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    # ~0.1 s a step here; PyTorch's own bf16 kernels on an AVX2-only CPU were ~2x that on this
    # model and 12x on SmolLM2. The bound only catches a fall back onto a pathological path.
    assert elapsed < 60, f"5 bf16 steps took {elapsed:.0f} s"


def test_bf16_and_fp32_trainers_agree_within_bf16_tolerance(tiny_model_dir):
    """The same adapter gives logprobs within 0.1 nats/token on average in bf16 and fp32."""
    lps = {}
    for dtype in ("float32", "bfloat16"):
        engine = TrainerEngine(tiny_model_dir, zero_stage=2, dtype=dtype)
        engine.create_model("m", LoraSpec(rank=8, seed=0))
        outputs, _ = engine.forward_backward("m", _data(), "cross_entropy", {}, forward_only=True)
        lps[dtype] = torch.cat([o["logprobs"] for o in outputs])
    gap = (lps["float32"] - lps["bfloat16"]).abs()
    assert gap.mean() < 0.1 and gap.max() > 0, gap     # different (bf16 rounds), but close


# Per position, after training at a high learning rate (issue 23): an AMX machine measured one
# position off by 1.35 nats on a tiny model while the others were within 0.04, and SmolLM2's base
# model differs by up to 0.2 nats (the engines' bf16 kernels round differently). Measured here
# (AVX512-BF16, this test's texts): max 0.03 with the lm_head adapter, 0.002 without; since the
# trainer rounds as vLLM's CPU kernels do (trainer_service/cpu_numerics.py), issue 23's targets
# hold where the stack runs on a CPU with native bf16. Elsewhere, the earlier bound: a GPU's vLLM
# kernels are others, and without native bf16 (--allow-slow-dtype) vLLM's bf16 is emulated (neither measured).
_MATCHED = hardware.native_bf16(gpu=False) and not torch.cuda.is_available()
MAX_GAP_PER_POSITION, MEAN_GAP = (0.05, 0.01) if _MATCHED else (0.25, 0.05)
TEXTS = [TOKENS[0][:10], TOKENS[1], [40, 3, 77, 12, 9, 100, 31, 2, 64, 18, 5]]


@pytest.mark.e2e
def test_bf16_trainer_and_sampler_logprobs_agree(tiny_model_dir, start_stack, tmp_path):
    """Through the SDK against `tinkerd up --dtype bfloat16`: SFT steps, a snapshot, and the
    sampler's logprob of every position of three texts against the trainer's, within the bf16
    tolerance above, at every position (a mean hides one position far off)."""
    import tinker
    from tinker import types

    flags = ("--dtype", "bfloat16") + (() if hardware.native_bf16() else ("--allow-slow-dtype",))
    with start_stack(tiny_model_dir, tmp_path / "state", *flags) as s:
        tc = tinker.ServiceClient(base_url=s.url).create_lora_training_client(base_model=tiny_model_dir, rank=8,
                                                                               seed=0).result()
        data = [types.Datum(model_input=types.ModelInput.from_ints(t[:-1]),
                            loss_fn_inputs={"target_tokens": t[1:], "weights": [1.0] * (len(t) - 1)})
                for t in TEXTS]
        losses = []
        for lr in (1e-2, 1e-2, 1e-2, 5e-2, 5e-2, 5e-2):     # then a high rate: a large adapter
            losses.append(tc.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
            tc.optim_step(types.AdamParams(learning_rate=lr)).result()
        assert all(b < a for a, b in zip(losses[:3], losses[1:3])), losses
        trained = [o["logprobs"].to_numpy() for o in tc.forward(data, "cross_entropy").result().loss_fn_outputs]
        sampler = tc.save_weights_and_get_sampling_client().result()
        sampled = [np.array(sampler.compute_logprobs(types.ModelInput.from_ints(t)).result()[1:]) for t in TEXTS]
        assert_reproducible_sampling(sampler, types.ModelInput.from_ints(TEXTS[0][:4]))
        # target_prompt_logprobs: the text's own tokens score as its prompt logprobs do, exactly;
        # other ids as the trainer's forward of them does, within the same tolerance.
        text = TEXTS[2]
        ids = np.stack([text[1:], [(t * 7 + 3) % 1024 for t in text[1:]]], axis=1)
        targets = sampler.sample(types.ModelInput.from_ints(text), 1, types.SamplingParams(max_tokens=1),
                                 target_prompt_logprobs=types.TensorData.from_numpy(ids)).result()
        targets = targets.target_prompt_logprobs.to_numpy()
        other = tc.forward([types.Datum(model_input=types.ModelInput.from_ints(text[:-1]),
                                        loss_fn_inputs={"target_tokens": ids[:, 1].tolist(),
                                                        "weights": [1.0] * len(ids)})], "cross_entropy").result()
        other = other.loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_array_equal(targets[:, 0], sampled[2].astype(np.float32))
    assert np.abs(targets[:, 1] - other).max() < MAX_GAP_PER_POSITION, (targets[:, 1], other)
    gaps = [np.abs(a - b) for a, b in zip(sampled, trained)]
    assert all(g.shape == (len(t) - 1,) for g, t in zip(gaps, TEXTS))
    worst = max(float(g.max()) for g in gaps)
    assert worst < MAX_GAP_PER_POSITION, [np.round(g, 3).tolist() for g in gaps]
    assert float(np.concatenate(gaps).mean()) < MEAN_GAP, [np.round(g, 3).tolist() for g in gaps]
