"""TrainerEngine: many LoRA models over one frozen base model, each under its own DeepSpeed engine.

Layout: one PEFT model holds the base and every adapter (named m0, m1, ...). Each LoRA model
gets a DeepSpeed ZeRO engine around an `AdapterModule` holding only its own parameters, with
its own torch AdamW: optimizer state, gradients and step count never mix between models.

This class is the facade over the rooms that do the work: registry.py (which models exist),
checkpoints.py (the adapter in PEFT form and the checkpoint directory format), training.py
(forward_backward / optim_step on DeepSpeed), deepspeed_setup.py. No gRPC here: the servicer
converts messages to the plain types of training.py.
"""

from __future__ import annotations

import logging
import os
import threading

import torch

from tinkerd import dtypes, weight_stream
from tinkerd.errors import NotFoundError, UserError
from trainer_service import adapter_snapshot, checkpoints, training
from trainer_service.deepspeed_setup import deepspeed_config, init_distributed_once  # noqa: F401 - public here
from trainer_service.losses import get_loss
from trainer_service.lora import LoraSpec
from trainer_service.registry import LoraModel, ModelRegistry, num_params
from trainer_service.training import AdamParams, DatumInput  # noqa: F401 - public here

log = logging.getLogger(__name__)

BASE_DTYPES = ("float32", "bfloat16", "float16")


class TrainerEngine:
    def __init__(self, base_model_dir: str, *, zero_stage: int = 2, dtype: str = "float32",
                 max_lora_rank: int = 64, base_model_names: tuple[str, ...] = ()):
        from transformers import AutoConfig, AutoModelForCausalLM

        if zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0-3, got {zero_stage}")
        if dtype not in BASE_DTYPES:
            raise ValueError(f"dtype must be one of {BASE_DTYPES}, got {dtype!r}")
        init_distributed_once()
        self.base_model_dir = base_model_dir
        self.base_model_names = {base_model_dir, os.path.abspath(base_model_dir), *base_model_names}
        self.zero_stage = zero_stage
        self.dtype = dtypes.torch_dtype(dtype)
        self.max_lora_rank = max_lora_rank
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        config = AutoConfig.from_pretrained(base_model_dir)
        self.vocab_size = config.vocab_size
        self.max_positions = getattr(config, "max_position_embeddings", 1 << 20)
        base = AutoModelForCausalLM.from_pretrained(base_model_dir, dtype=dtypes.torch_dtype(dtype)).to(self.device)
        base.requires_grad_(False)
        self.models = ModelRegistry(base, base_model_dir, zero_stage=zero_stage, max_lora_rank=max_lora_rank)
        self.peft = self.models.peft
        # One lock for all of it: the PEFT model's active adapter is process-wide state, so
        # no two models may run (or be added, removed, exported) at the same time.
        self._lock = threading.RLock()

    # ---- models ---------------------------------------------------------------------------

    def accepts_base_model(self, name: str) -> bool:
        return name in self.base_model_names

    def get(self, model_id: str) -> LoraModel:
        """The model, reloaded from its checkpoint first if it was unloaded."""
        with self._lock:
            model = self.models.resident(model_id)
            path = self.models.unpark(model_id) if model is None else None
            if path is not None:
                try:
                    model = self.load_state(model_id, path, with_optimizer=True)
                except BaseException:
                    self.models.park(model_id, path)
                    raise
                log.info("reloaded %s from %s", model_id, path)
            if model is None:
                raise NotFoundError(f"unknown model_id {model_id!r}")
            return model

    def is_resident(self, model_id: str) -> bool:
        return self.models.resident(model_id) is not None

    def model_ids(self) -> tuple[list[str], list[str]]:
        """(resident, unloaded) model ids."""
        with self._lock:
            return self.models.ids()

    def create_model(self, model_id: str, spec: LoraSpec,
                     initial: dict[str, torch.Tensor] | None = None) -> LoraModel:
        """A new LoRA model; `initial` (PEFT-named adapter tensors) replaces the random init."""
        self.models.check_spec(spec)
        with self._lock:
            if self.models.known(model_id):
                return self.get(model_id)
            return self.models.add(model_id, spec, initial)

    def delete_model(self, model_id: str) -> bool:
        with self._lock:
            return self.models.remove(model_id)

    def unload_model(self, model_id: str, directory: str) -> str:
        """Frees the model's memory after writing its full state (adapter, optimizer, step) to
        `directory`; the next call that uses it reloads it from there, transparently."""
        with self._lock:
            parked = self.models.parked(model_id)
            if parked is not None:
                return parked
            self.save_state(model_id, directory, with_optimizer=True)
            self.models.remove(model_id)
            self.models.park(model_id, directory)
            log.info("unloaded %s to %s", model_id, directory)
            return directory

    def num_params(self, model: LoraModel) -> int:
        return num_params(model)

    # ---- checkpoints ----------------------------------------------------------------------

    def save_state(self, model_id: str, directory: str, *, with_optimizer: bool) -> int:
        """Writes the checkpoint atomically; returns its size in bytes."""
        with self._lock:
            model = self.get(model_id)
            tensors, config = self.export_adapter(model_id)
            tmp = checkpoints.temporary_path(directory)
            checkpoints.write_state(tmp, model, tensors, config, base_model_dir=self.base_model_dir,
                                    zero_stage=self.zero_stage, with_optimizer=with_optimizer)
        return checkpoints.commit_state(tmp, directory)

    def load_state(self, model_id: str, directory: str, *, with_optimizer: bool) -> LoraModel:
        """Creates `model_id` from a checkpoint: its adapter weights, and with_optimizer its AdamW
        state and step count too."""
        spec, tensors, step = checkpoints.read_state(directory, with_optimizer=with_optimizer,
                                                     zero_stage=self.zero_stage)
        with self._lock:
            if self.is_resident(model_id):
                raise UserError(f"model {model_id!r} already exists")
            model = self.create_model(model_id, spec, initial=tensors)
            if with_optimizer:
                try:
                    checkpoints.restore_optimizer(model, directory, step)
                except BaseException:
                    self.models.remove(model_id)     # no half-restored model stays behind
                    raise
            return model

    def export_adapter(self, model_id: str) -> tuple[dict[str, torch.Tensor], dict]:
        """The adapter's full tensors (gathered under ZeRO-3) with PEFT names, and its config."""
        with self._lock:
            return checkpoints.export_adapter(self.peft, self.get(model_id), zero_stage=self.zero_stage,
                                              base_model_dir=self.base_model_dir)

    def snapshot_adapter(self, model_id: str) -> tuple[weight_stream.Packed, dict]:
        """The adapter for a weight push: gathered straight into send chunks in the serving dtype
        (the base model's: a sampler's LoRA dtype follows its model dtype), and its config."""
        with self._lock:
            model = self.get(model_id)
            packed = adapter_snapshot.gather(self.peft, model, zero_stage=self.zero_stage,
                                             dtype=self.dtype)
            return packed, checkpoints.adapter_config(self.peft, model, self.base_model_dir)

    # ---- training -------------------------------------------------------------------------

    def forward_backward(self, model_id: str, data: list[training.DatumInput], loss_fn: str,
                         loss_fn_config: dict[str, float], *, forward_only: bool):
        """Returns (per-datum outputs, metrics). Gradients accumulate until optim_step."""
        loss_impl = get_loss(loss_fn)
        training.validate(data, vocab_size=self.vocab_size, max_positions=self.max_positions)
        with self._lock:
            return training.forward_backward(self.get(model_id), data, loss_impl, loss_fn_config,
                                             forward_only=forward_only, device=self.device)

    def optim_step(self, model_id: str, adam: training.AdamParams) -> dict[str, float]:
        training.check_adam(adam)
        with self._lock:
            return training.optim_step(self.get(model_id), adam, zero_stage=self.zero_stage, device=self.device)
