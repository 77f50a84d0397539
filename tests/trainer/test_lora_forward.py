"""trainer_service/lora.py's fused fp32 LoRA forward: what PEFT's forward computes, without its
passes over the layer's output for `delta * scaling`: bit for bit at the power-of-two scalings
Tinker's fixed alpha gives ranks 1, 2, 4, ..., 128, within rounding at any other rank; and no
more kept for the backward than PEFT keeps (microbatches.measure prices a token by that)."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

from trainer_service.lora import LORA_ALPHA, install_fused_forward


def _pair(rank: int, dtype=torch.float32, dropout: float = 0.0):
    """Two equal PEFT models of one Linear with a trained-looking adapter (B not zero): PEFT's
    forward, and the fused one."""
    torch.manual_seed(rank)
    base = torch.nn.Sequential()
    base.add_module("proj", torch.nn.Linear(48, 40, bias=False, dtype=dtype))
    peft = get_peft_model(base, LoraConfig(r=rank, lora_alpha=LORA_ALPHA, lora_dropout=dropout,
                                           target_modules=["proj"]))
    with torch.no_grad():
        peft.base_model.model.proj.lora_B["default"].weight.normal_()
    fused = copy.deepcopy(peft)
    return peft, fused, install_fused_forward(fused)


def _run(model, x: torch.Tensor, weights: torch.Tensor):
    x = x.clone().requires_grad_(True)
    out = model(x)
    (out * weights).sum().backward()
    layer = model.base_model.model.proj
    return out.detach(), x.grad, layer.lora_A["default"].weight.grad, layer.lora_B["default"].weight.grad


@pytest.mark.parametrize("rank", [4, 16, 32, 12])
def test_the_fused_forward_computes_what_peft_does(rank):
    peft, fused, installed = _pair(rank)
    assert installed == 1
    x, weights = torch.randn(3, 7, 48), torch.randn(3, 7, 40)
    expected, got = _run(peft, x, weights), _run(fused, x, weights)
    scaling = LORA_ALPHA / rank
    if scaling.is_integer() or (1 / scaling).is_integer():
        for a, b in zip(expected, got):        # output, input gradient, A's and B's gradients
            assert torch.equal(a, b)
    else:
        for a, b in zip(expected, got):      # sums of products of both signs: relative to the largest
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5 * float(a.abs().max()))


@pytest.mark.parametrize("rank", [8, 32, 12])
def test_the_backward_keeps_what_pefts_keeps(rank):
    """Per token, and nothing per forward (a scaled copy of B kept would count as activations)."""
    from trainer_service.microbatches import saved_bytes

    peft, fused, _ = _pair(rank)
    for length in (4, 16):
        x = torch.randn(2, length, 48, requires_grad=True)
        assert saved_bytes(fused, lambda: fused(x)) == saved_bytes(peft, lambda: peft(x))


def test_merged_disabled_and_dropout_layers_take_peft_forward():
    peft, fused, _ = _pair(8)
    x = torch.randn(2, 5, 48)
    with torch.no_grad():
        unmerged = fused(x)
        fused.base_model.model.proj.merge()          # the delta now sits in the base weight
        torch.testing.assert_close(fused(x), unmerged, rtol=1e-5, atol=1e-5)   # not added twice
        fused.base_model.model.proj.unmerge()
        with fused.disable_adapter():
            assert torch.equal(fused(x), fused.base_model.model.proj.base_layer(x))
    dropping, fused_dropping, _ = _pair(8, dropout=0.5)
    torch.manual_seed(0)
    a = dropping(x)
    torch.manual_seed(0)
    assert torch.equal(fused_dropping(x), a)          # the same dropout mask: PEFT's own path


def test_16_bit_layers_keep_their_forward():
    _, _, installed = _pair(8, dtype=torch.bfloat16)
    assert installed == 0
