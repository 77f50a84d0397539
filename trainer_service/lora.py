"""LoRA adapters over the one shared base model: target-module selection from Tinker's
train_attn / train_mlp / train_unembed flags, and the per-adapter module DeepSpeed wraps."""

from __future__ import annotations

import dataclasses

import torch
from peft import LoraConfig

# Attribute on the shared PEFT model: the adapter AdapterModule last activated.
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
        set_adapter walks every module: skip it when the last one we set is still in place.
        The engine clears the mark whenever adapters are added or removed."""
        if getattr(self._peft_model, ACTIVE_MARK, None) != self.adapter_name:
            self._peft_model.base_model.set_adapter(self.adapter_name)
            setattr(self._peft_model, ACTIVE_MARK, self.adapter_name)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        self.activate()
        return self._peft_model(input_ids=input_ids, attention_mask=attention_mask).logits
