"""LoRA adapters over the one shared base model: target-module selection from Tinker's
train_attn / train_mlp / train_unembed flags, and the per-adapter module DeepSpeed wraps."""

from __future__ import annotations

import dataclasses
import types

import torch
from peft import LoraConfig
from peft.tuners.tuners_utils import BaseTunerLayer

from tinkerd.optimizers import ADAMW
from trainer_service.logprobs import token_logprobs

# Attribute on the shared PEFT model: the `_Active` adapter AdapterModule last activated (None
# after adapters were added or removed: then the next activation is PEFT's full set_adapter).
ACTIVE_MARK = "_tinkerd_active_adapter"

# Tinker fixes alpha rather than scaling it with the rank; 32 is its documented default.
LORA_ALPHA = 32


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    rank: int
    seed: int | None
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    optimizer: str = ADAMW       # fixed for the model's life (tinkerd/optimizers.py)


def linear_groups(base: torch.nn.Module) -> dict[str, list[str]]:
    """Leaf names of the base model's Linear layers by Tinker flag group. Call it on the
    unwrapped base (before PEFT wraps layers in base_layer / lora_* submodules)."""
    groups: dict[str, set[str]] = {"attn": set(), "mlp": set(), "unembed": set()}
    output = base.get_output_embeddings()
    for qualified, module in base.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        leaf = qualified.rsplit(".", 1)[-1]
        if module is output:
            groups["unembed"].add(leaf)
        elif "attn" in qualified or "attention" in qualified:
            groups["attn"].add(leaf)
        elif "mlp" in qualified or "feed_forward" in qualified:
            groups["mlp"].add(leaf)
    return {k: sorted(v) for k, v in groups.items()}


def peft_config(groups: dict[str, list[str]], spec: LoraSpec) -> LoraConfig:
    targets = ((groups["attn"] if spec.train_attn else []) + (groups["mlp"] if spec.train_mlp else [])
               + (groups["unembed"] if spec.train_unembed else []))
    return LoraConfig(r=spec.rank, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                      target_modules=targets, bias="none")


def plain_adapter(layer, args: tuple, kwargs: dict) -> str | None:
    """The name of a PEFT LoRA Linear's one active adapter where its forward is just base +
    x @ A^T @ B^T * scaling (what a replacement forward may compute its own way); None where PEFT's
    forward must run: several or no active adapters, merged weights, disabled adapters, dropout,
    DoRA, a LoRA bias, per-row adapter names or other extra arguments."""
    active = layer.active_adapters
    name = active[0] if len(active) == 1 else None
    if (args or kwargs or layer.disable_adapters or layer.merged or name not in layer.lora_A
            or layer.use_dora.get(name) or not isinstance(layer.lora_dropout[name], torch.nn.Identity)
            or layer.lora_B[name].bias is not None):
        return None
    return name


def install_forward(peft_model: torch.nn.Module, forward, dtypes: tuple[torch.dtype, ...]) -> list[torch.nn.Module]:
    """`forward` on the LoRA Linear layers of `peft_model` whose base weights are of `dtypes` and
    that do not have it yet (those added since the last call: call it after every add_adapter);
    returns them."""
    from peft.tuners.lora import Linear as LoraLinear

    installed = []
    for module in peft_model.modules():
        if (type(module) is LoraLinear and module.base_layer.weight.dtype in dtypes
                and getattr(module.forward, "__func__", None) is not forward):
            module.forward = types.MethodType(forward, module)
            installed.append(module)
    return installed


def _fused_forward(self, x, *args, **kwargs):
    """PEFT's lora.Linear forward for its one active fp32 adapter on an fp32 layer, without the
    two passes over the layer's output PEFT spends on `delta * scaling` (in the forward, and
    again in the backward, even at scaling 1): base + ((x @ A^T) * scaling) @ B^T, the scaling
    on the [tokens, rank] product. Tinker's fixed alpha gives ranks 1, 2, 4, ..., 128 a power-of-two
    scaling, so this is PEFT's result bit for bit; other ranks differ in rounding only. (Scaling
    B instead, as vLLM folds it, would keep a scaled copy of B for the backward, which
    microbatches.measure would count as activations.) Anything but a plain adapter
    (`plain_adapter`) on fp32 input takes PEFT's own."""
    name = plain_adapter(self, args, kwargs)
    if name is None or x.dtype != torch.float32:
        return type(self).forward(self, x, *args, **kwargs)
    result = self.base_layer(x)
    h = torch.nn.functional.linear(x, self.lora_A[name].weight)
    scaling = self.scaling[name]
    if scaling != 1:
        h = h * scaling
    return result + torch.nn.functional.linear(h, self.lora_B[name].weight)


def install_fused_forward(peft_model: torch.nn.Module) -> int:
    """_fused_forward on the fp32 LoRA Linear layers added since the last call; returns how many.
    16-bit layers keep theirs (cpu_numerics.install_lora on CPU, PEFT's on GPU)."""
    return len(install_forward(peft_model, _fused_forward, (torch.float32,)))


@dataclasses.dataclass(frozen=True)
class _Active:
    name: str
    params: list[torch.nn.Parameter]
    layers: list[torch.nn.Module]       # PEFT's tuner layers, found once per full set_adapter


class AdapterModule(torch.nn.Module):
    """What one DeepSpeed engine wraps: one adapter's parameters, registered *directly* on this
    module so ZeRO-3's pre-forward hook gathers them, and a forward that runs the shared PEFT
    model with this adapter active. The base weights stay outside every engine: frozen and
    shared by all adapters."""

    def __init__(self, peft_model, adapter_name: str, params: list[torch.nn.Parameter]):
        super().__init__()
        object.__setattr__(self, "_peft_model", peft_model)  # not a submodule: never wrapped
        self.adapter_name = adapter_name
        for i, p in enumerate(params):
            self.register_parameter(f"lora_{i}", p)

    def activate(self) -> None:
        """Makes this adapter the active one (and its parameters the ones requiring grad).
        PEFT's set_adapter walks every module and sets requires_grad on every adapter's every
        layer, which made a step round-robin over many adapters far slower than a step on one
        (docs/benchmarks.md#in-the-trainer). After the first full switch only two adapters
        change: the one that was active and this one; the engine clears the mark whenever
        adapters are added or removed."""
        active = getattr(self._peft_model, ACTIVE_MARK, None)
        if active is not None and active.name == self.adapter_name:
            return
        params = list(self.parameters())
        if active is None:
            self._peft_model.base_model.set_adapter(self.adapter_name)
            layers = [m for m in self._peft_model.modules() if isinstance(m, BaseTunerLayer)]
        else:
            layers = active.layers
            for p in active.params:
                p.requires_grad_(False)
            for layer in layers:
                layer._active_adapter = [self.adapter_name]     # what BaseTunerLayer.set_adapter stores
            for p in params:
                p.requires_grad_(True)
            self._peft_model.base_model.active_adapter = self.adapter_name
        setattr(self._peft_model, ACTIVE_MARK, _Active(self.adapter_name, params, layers))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                targets: torch.Tensor | None = None, **how):
        """The logits; with `targets`, their log-probabilities instead (logprobs.py; `how`: its
        keywords), computed inside this forward so that ZeRO-3's gathered parameters serve the
        unembedding too."""
        self.activate()
        if targets is None:
            return self._peft_model(input_ids=input_ids, attention_mask=attention_mask).logits
        return token_logprobs(self._peft_model.get_base_model(), input_ids, attention_mask, targets, **how)
