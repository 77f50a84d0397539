"""The trainer's LoRA models: adapters m0, m1, ... in the one shared PEFT model, each wrapped by
its own DeepSpeed engine, and the models unloaded to disk ("parked") until their next use.

Bookkeeping only and not thread-safe: TrainerEngine calls it under its one lock.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from tinkerd.errors import UserError
from trainer_service.deepspeed_setup import adapter_engine
from trainer_service.lora import ACTIVE_MARK, LoraSpec, linear_groups, peft_config

log = logging.getLogger(__name__)


@dataclasses.dataclass
class LoraModel:
    model_id: str
    adapter_name: str
    spec: LoraSpec
    engine: object            # deepspeed.DeepSpeedEngine
    params: list[torch.nn.Parameter]
    step: int = 0


def num_params(model: LoraModel) -> int:
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in model.params)


class ModelRegistry:
    def __init__(self, base: torch.nn.Module, base_model_dir: str, *, zero_stage: int, max_lora_rank: int):
        from peft import LoraConfig, get_peft_model

        self.zero_stage = zero_stage
        self.max_lora_rank = max_lora_rank
        self._linear_groups = linear_groups(base)
        if not any(self._linear_groups.values()):
            raise ValueError(f"{base_model_dir}: found no Linear layers to put LoRA on")
        # A rank-1 placeholder so the PEFT wrapper exists before any tenant; never active.
        first = next(names for names in self._linear_groups.values() if names)[:1]
        self.peft = get_peft_model(base, LoraConfig(r=1, target_modules=first), adapter_name="_placeholder")
        self.peft.eval()  # no dropout; LoRA dropout is 0 anyway
        self._models: dict[str, LoraModel] = {}
        # Unloaded models: model_id -> checkpoint directory they come back from on next use.
        self._parked: dict[str, str] = {}
        self._next_adapter = 0

    def resident(self, model_id: str) -> LoraModel | None:
        return self._models.get(model_id)

    def known(self, model_id: str) -> bool:
        return model_id in self._models or model_id in self._parked

    def ids(self) -> tuple[list[str], list[str]]:
        """(resident, unloaded) model ids."""
        return list(self._models), list(self._parked)

    def check_spec(self, spec: LoraSpec) -> None:
        if not 1 <= spec.rank <= self.max_lora_rank:
            raise UserError(f"LoRA rank must be in 1..{self.max_lora_rank}, got {spec.rank}")
        if not (spec.train_attn or spec.train_mlp or spec.train_unembed):
            raise UserError("at least one of train_attn, train_mlp, train_unembed must be true")

    def add(self, model_id: str, spec: LoraSpec, initial: dict[str, torch.Tensor] | None) -> LoraModel:
        """A new adapter for `model_id`; `initial` (PEFT-named adapter tensors) replaces the random init."""
        name = f"m{self._next_adapter}"
        self._next_adapter += 1
        seed = spec.seed if spec.seed is not None else int.from_bytes(os.urandom(4), "little")
        setattr(self.peft, ACTIVE_MARK, None)     # adding/removing adapters moves PEFT's active one
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.peft.add_adapter(name, peft_config(self._linear_groups, spec))
        if initial is not None:
            self._load_initial(name, spec, initial)
        params = [p for n, p in self.peft.named_parameters() if f".{name}." in n]
        for p in params:
            p.requires_grad_(True)
        model = LoraModel(model_id, name, spec, adapter_engine(self.peft, name, params, self.zero_stage), params)
        self._models[model_id] = model
        log.info("created %s (adapter %s, rank %d, %d params)", model_id, name, spec.rank, num_params(model))
        return model

    def _load_initial(self, name: str, spec: LoraSpec, initial: dict[str, torch.Tensor]) -> None:
        from peft import set_peft_model_state_dict

        try:
            result = set_peft_model_state_dict(self.peft, initial, adapter_name=name)
            missing = [k for k in result.missing_keys if f".{name}." in k]
            problem = (f"missing {missing[:2]}, unexpected {list(result.unexpected_keys)[:2]}"
                       if missing or result.unexpected_keys else None)
        except RuntimeError as e:        # shape mismatch: another base model
            problem = str(e).splitlines()[0]
        if problem:
            self.peft.base_model.delete_adapter(name)
            raise UserError(f"the checkpoint does not fit a rank-{spec.rank} adapter on this base "
                            f"model ({problem})")

    def remove(self, model_id: str) -> bool:
        """Forgets the model, resident or parked; frees its adapter and engine."""
        parked = self._parked.pop(model_id, None) is not None
        model = self._models.pop(model_id, None)
        if model is None:
            return parked
        model.engine.destroy()
        setattr(self.peft, ACTIVE_MARK, None)
        self.peft.base_model.delete_adapter(model.adapter_name)
        return True

    def park(self, model_id: str, directory: str) -> None:
        """Lists the model as unloaded to `directory`, until `unpark`."""
        self._parked[model_id] = directory

    def parked(self, model_id: str) -> str | None:
        return self._parked.get(model_id)

    def unpark(self, model_id: str) -> str | None:
        """The directory of a parked model, no longer listed as parked."""
        return self._parked.pop(model_id, None)
