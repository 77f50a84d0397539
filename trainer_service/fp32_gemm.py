"""The frozen base model's 16-bit Linear layers computed by fp32 GEMMs, on CPUs without native
bf16/fp16 math.

There PyTorch has no 16-bit GEMM kernel (oneDNN's needs AVX512-BF16/AMX) and falls back to
generic loops, many times slower than fp32's; the lm_head's input gradient over a large
vocabulary alone was most of a bf16 training step (docs/benchmarks.md#in-the-trainer). Widening
the operands to fp32, one MKL sgemm, and rounding the result back computes what a native bf16
GEMM does (bf16 operands are exact in fp32, the sum is accumulated in fp32, the output is
rounded to bf16), so weights and activations stay 16-bit and logprobs stay the dtype's; only the
kernel changes. Where the hardware has bf16 math this is not installed (its kernels are faster
than widening).
"""

from __future__ import annotations

import logging
import types

import torch
import torch.nn.functional as F

from tinkerd import hardware

log = logging.getLogger(__name__)

HALF_DTYPES = (torch.bfloat16, torch.float16)


class _WidenedLinear(torch.autograd.Function):
    """y = x W^T + b for a frozen 16-bit W: fp32 GEMMs forward and backward, 16-bit tensors in and out.
    Only x gets a gradient (the weights are frozen; LoRA's own layers are separate fp32 modules)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(weight)
        ctx.x_dtype = x.dtype
        out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        return out.to(weight.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (weight,) = ctx.saved_tensors
        grad_x = (grad.float() @ weight.float()).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        return grad_x, None, None


def _widened_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return _WidenedLinear.apply(x, self.weight, self.bias)


def install(model: torch.nn.Module) -> int:
    """Routes every frozen 16-bit nn.Linear of `model` through fp32 GEMMs; returns how many.
    Call it on the frozen base before adapters are added: LoRA's layers are fp32 and trainable."""
    count = 0
    for module in model.modules():
        if type(module) is not torch.nn.Linear or module.weight.dtype not in HALF_DTYPES:
            continue
        if any(p.requires_grad for p in module.parameters()):
            raise ValueError("fp32_gemm.install is for frozen layers: their weights get no gradient")
        module.forward = types.MethodType(_widened_forward, module)
        count += 1
    return count


def install_where_needed(base: torch.nn.Module) -> int:
    """install() on a 16-bit base model on a CPU without native 16-bit math; elsewhere nothing."""
    on_cpu = next(base.parameters()).device.type == "cpu"
    if base.dtype not in HALF_DTYPES or not on_cpu or hardware.native_bf16(gpu=False):
        return 0
    count = install(base)
    log.info("no native 16-bit math on this CPU: %d %s Linear layers run as fp32 GEMMs", count, base.dtype)
    return count
