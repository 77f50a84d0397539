"""The trainer's resident LoRA models: adapters m0, m1, ... in the one shared PEFT model, each
wrapped by its own DeepSpeed engine. (Models not resident live on disk: durable.py.)

A model that is unloaded (evicted) leaves its adapter and engine behind as a spare slot, and a
model of the same shape that comes back from a full checkpoint takes it over: its tensors are
copied into the slot's parameters and its optimizer state loaded into the slot's engine, which
overwrites everything the previous owner left there. Building a slot (PEFT injecting an adapter
into every layer, DeepSpeed wrapping it) is most of what a reload would otherwise cost.

Bookkeeping only and not thread-safe: TrainerEngine calls it under its one lock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os

import torch

from tinkerd.errors import UserError
from tinkerd.optimizers import DIMUON, OPTIMIZERS
from trainer_service import cpu_numerics
from trainer_service.deepspeed_setup import adapter_engine, model_zero_stage
from trainer_service.lora import ACTIVE_MARK, LoraSpec, install_fused_forward, linear_groups, peft_config

log = logging.getLogger(__name__)

# Spare slots kept at most: eviction frees one just before a reload needs one, so a few cover
# tenants of mixed shapes; each holds an adapter's weights and AdamW moments in memory.
SPARE_SLOTS = 4


@dataclasses.dataclass
class LoraModel:
    model_id: str
    adapter_name: str
    spec: LoraSpec
    engine: object            # deepspeed.DeepSpeedEngine
    params: list[torch.nn.Parameter]
    step: int = 0
    state_seq: int = 0        # seq_id of the last optim_step in the weights (0: as created)
    durable_seq: int = -1     # state_seq when the durable state was last written; -1: never
    pending_grads: bool = False   # gradients accumulated since the last optim_step
    nonfinite_loss: bool = False  # a forward_backward since the last optim_step had a NaN/inf loss: skip it
    last_used: float = 0.0    # monotonic; the least recently used model is evicted first


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
        self._next_adapter = 0
        self._param_names: dict[str, list[str]] = {}   # adapter name -> its parameters' PEFT names
        self._spare: list[LoraModel] = []     # slots left by unloaded models, oldest first

    def resident(self, model_id: str) -> LoraModel | None:
        return self._models.get(model_id)

    def ids(self) -> list[str]:
        return list(self._models)

    def all(self) -> list[LoraModel]:
        return list(self._models.values())

    def check_spec(self, spec: LoraSpec) -> None:
        if not 1 <= spec.rank <= self.max_lora_rank:
            raise UserError(f"LoRA rank must be in 1..{self.max_lora_rank}, got {spec.rank}")
        if not (spec.train_attn or spec.train_mlp or spec.train_unembed):
            raise UserError("at least one of train_attn, train_mlp, train_unembed must be true")
        if spec.optimizer not in OPTIMIZERS:
            raise UserError(f"optimizer {spec.optimizer!r} is not supported: use one of {list(OPTIMIZERS)}")
        if spec.optimizer == DIMUON and self.zero_stage == 3:
            raise UserError("the dimuon optimizer steps each LoRA matrix whole, and this trainer partitions "
                            "them (ZeRO-3): use adamw here, or a trainer run with --zero-stage 0, 1 or 2")

    def add(self, model_id: str, spec: LoraSpec, initial: dict[str, torch.Tensor] | None, *,
            reuse: bool = False) -> LoraModel:
        """A new adapter for `model_id`; `initial` (PEFT-named adapter tensors) replaces the random init.
        `reuse`: the caller overwrites the optimizer state next (a full checkpoint), so a spare
        slot of the same shape may be taken instead of building one."""
        if reuse and initial is not None:
            model = self._take_spare(model_id, spec, initial)
            if model is not None:
                return model
        name = f"m{self._next_adapter}"
        self._next_adapter += 1
        seed = spec.seed if spec.seed is not None else int.from_bytes(os.urandom(4), "little")
        setattr(self.peft, ACTIVE_MARK, None)     # adding/removing adapters moves PEFT's active one
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.peft.add_adapter(name, peft_config(self._linear_groups, spec))
        self._install_forwards()
        if initial is not None:
            self._load_initial(name, spec, initial)
        named = [(n, p) for n, p in self.peft.named_parameters() if f".{name}." in n]
        self._param_names[name] = [n.replace(f".{name}", "") for n, _ in named]   # as PEFT saves them
        params = [p for _, p in named]
        for p in params:
            p.requires_grad_(True)
        engine = adapter_engine(self.peft, name, params, model_zero_stage(self.zero_stage, spec.optimizer),
                                spec.optimizer, spec.rank)
        model = LoraModel(model_id, name, spec, engine, params)
        self._models[model_id] = model
        log.info("created %s (adapter %s, rank %d, %d params)", model_id, name, spec.rank, num_params(model))
        return model

    def _install_forwards(self) -> None:
        """New LoRA layers' forwards: a 16-bit one on CPU rounds as the sampler's
        (cpu_numerics), an fp32 one skips PEFT's passes for the scaling (lora.py)."""
        cpu_numerics.install_lora(self.peft)
        install_fused_forward(self.peft)

    @contextlib.contextmanager
    def costliest_adapter(self):
        """The costliest adapter this trainer accepts (the largest rank, every target module),
        active for a measurement (microbatches.py) and gone after; no RNG drawn from."""
        name, before = "_probe", list(self.peft.base_model.active_adapters)
        setattr(self.peft, ACTIVE_MARK, None)
        with torch.random.fork_rng(devices=[]):
            self.peft.add_adapter(name, peft_config(self._linear_groups, LoraSpec(self.max_lora_rank, 0)))
        self._install_forwards()
        try:
            self.peft.base_model.set_adapter(name)
            yield
        finally:
            self.peft.base_model.set_adapter(before)
            self.peft.base_model.delete_adapter(name)
            setattr(self.peft, ACTIVE_MARK, None)

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

    def _take_spare(self, model_id: str, spec: LoraSpec, initial: dict[str, torch.Tensor]) -> LoraModel | None:
        """A spare slot of `spec`'s shape with `initial` copied into its parameters, or None."""
        for slot in self._spare:
            names = self._param_names[slot.adapter_name]
            if (_shape(slot.spec) == _shape(spec) and set(initial) == set(names)
                    and all(initial[n].shape == p.shape for n, p in zip(names, slot.params))):
                break
        else:
            return None
        self._spare.remove(slot)
        with torch.no_grad():
            for n, p in zip(names, slot.params):
                p.copy_(initial[n])
                p.requires_grad_(True)
        model = LoraModel(model_id, slot.adapter_name, spec, slot.engine, slot.params)
        self._models[model_id] = model
        log.info("loaded %s into the spare adapter %s (rank %d)", model_id, slot.adapter_name, spec.rank)
        return model

    def remove(self, model_id: str, *, keep_slot: bool = False) -> bool:
        """Forgets the resident model; frees its adapter and engine, or with `keep_slot` keeps
        them as a spare slot for a model of the same shape (not under ZeRO-3, whose partitioned
        parameters load only through DeepSpeed)."""
        model = self._models.pop(model_id, None)
        if model is None:
            return False
        if keep_slot and self.zero_stage != 3:
            self._spare.append(model)
            if len(self._spare) <= SPARE_SLOTS:
                return True
            model = self._spare.pop(0)
        self._destroy(model)
        return True

    def _destroy(self, model: LoraModel) -> None:
        model.engine.destroy()
        setattr(self.peft, ACTIVE_MARK, None)
        self.peft.base_model.delete_adapter(model.adapter_name)
        self._param_names.pop(model.adapter_name, None)


def _shape(spec: LoraSpec) -> tuple:
    """What decides an adapter's parameter shapes and its engine's optimizer (all but the seed)."""
    return spec.rank, spec.train_attn, spec.train_mlp, spec.train_unembed, spec.optimizer
