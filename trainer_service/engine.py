"""TrainerEngine: many LoRA models over one frozen base model, each under its own DeepSpeed engine.

Layout: one PEFT model holds the base and every adapter (named m0, m1, ...). Each LoRA model
gets a DeepSpeed ZeRO engine around an `AdapterModule` holding only its own parameters, with
its own optimizer, torch's AdamW or Dimuon (dimuon.py), chosen at creation and fixed: optimizer
state, gradients and step count never mix between models. On one rank, ZeRO-1 and -2 partition
nothing and run as stage 0 (deepspeed_setup.effective_zero_stage); a Dimuon model's engine runs as
stage 0 on any number of ranks (deepspeed_setup.model_zero_stage).

This class is the facade over the rooms that do the work: registry.py (which models exist),
checkpoints.py (the adapter in PEFT form and the checkpoint directory format), training.py
(forward_backward / optim_step on DeepSpeed), deepspeed_setup.py. No gRPC here: the servicer
converts messages to the plain types of training.py.

Under a launcher with W ranks every rank holds a TrainerEngine; the methods marked @collective
run on all of them in the same order (ranks.py: rank 0 sends each call to the others).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import threading
import time

import torch

from tinkerd import cores, dtypes, hardware, weight_stream
from tinkerd.errors import NotFoundError, UserError
from tinkerd.optimizers import ADAMW, DIMUON, PARAMS_CLASS
from trainer_service import adapter_snapshot, checkpoints, cpu_numerics, fp32_gemm, microbatches, prefix_tree, training
from trainer_service.durable import DurableModels
from trainer_service.logprobs import default_logits_bytes
from trainer_service.deepspeed_setup import (deepspeed_config, effective_zero_stage,  # noqa: F401 - public here
                                             init_distributed_once, model_zero_stage)
from trainer_service.custom_loss import Losses
from trainer_service.losses import get_loss
from trainer_service.lora import LoraSpec
from trainer_service.metrics import EVICTIONS, RELOADS
from trainer_service.ranks import Ranks, collective
from trainer_service.registry import LoraModel, ModelRegistry, num_params
from trainer_service.training import AdamParams, DatumInput, DimuonParams  # noqa: F401 - public here

log = logging.getLogger(__name__)

BASE_DTYPES = ("float32", "bfloat16", "float16")


class TrainerEngine:
    def __init__(self, base_model_dir: str, *, zero_stage: int = 2, dtype: str = "float32",
                 max_lora_rank: int = 64, base_model_names: tuple[str, ...] = (),
                 durable: DurableModels | None = None, max_resident: int = 32, keep_zero_stage: bool = False,
                 max_batch_tokens: int = training.MAX_BATCH_TOKENS, match_sampler: bool = True,
                 max_logits_mib: int = 0, activation_mib: int = 0):
        """`keep_zero_stage`: run `zero_stage` as given even on one rank, where stages 1 and 2
        partition nothing (as trainers did before they ran those as stage 0; tests write such
        checkpoints with it). `match_sampler`: a 16-bit model on CPU rounds as the sampler's vLLM
        CPU kernels do (cpu_numerics.py), so both give the same logprobs; False leaves
        transformers' own rounding (bench/bf16_gap.py measures the difference). `max_logits_mib`:
        the fp32 logits a forward_backward holds at once; more go in recomputed chunks (logprobs.py;
        0: per device). `activation_mib`: the activations a forward_backward keeps for its backward
        at once; a larger batch goes in micro-batches (microbatches.py; 0: a share of the device's memory)."""
        from transformers import AutoConfig, AutoModelForCausalLM

        if zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0-3, got {zero_stage}")
        if dtype not in BASE_DTYPES:
            raise ValueError(f"dtype must be one of {BASE_DTYPES}, got {dtype!r}")
        init_distributed_once()
        self.base_model_dir = base_model_dir
        self.base_model_names = {base_model_dir, os.path.abspath(base_model_dir), *base_model_names}
        self.zero_stage = zero_stage if keep_zero_stage else _stage_for_this_job(zero_stage)
        self.dtype = dtypes.torch_dtype(dtype)
        self.max_lora_rank = max_lora_rank
        self.durable = durable
        self.max_resident = max_resident
        self.max_batch_tokens = max_batch_tokens
        self.device = hardware.default_device()
        config = AutoConfig.from_pretrained(base_model_dir)
        self.vocab_size = config.vocab_size
        self.max_positions = getattr(config, "max_position_embeddings", 1 << 20)
        base = AutoModelForCausalLM.from_pretrained(base_model_dir, dtype=dtypes.torch_dtype(dtype)).to(self.device)
        base.requires_grad_(False)
        fp32_gemm.install_where_needed(base)
        cores.tick_in_layers(base)        # a long step follows the host's core board layer by layer
        if match_sampler:
            cpu_numerics.install_where_needed(base)
        # Token trees after cpu_numerics: its attention is the one paths run through.
        self.packable = prefix_tree.install(base)
        self.models = ModelRegistry(base, base_model_dir, zero_stage=self.zero_stage, max_lora_rank=max_lora_rank)
        self.peft = self.models.peft
        # One lock for all of it: the PEFT model's active adapter is process-wide state, so
        # no two models may run (or be added, removed, exported) at the same time.
        self._lock = threading.RLock()
        self.ranks = Ranks(self._lock)
        self.custom_losses = Losses()
        self.activation_budget = (activation_mib << 20) or microbatches.default_budget_bytes(self.device)
        self.max_logits_bytes = (max_logits_mib << 20) or default_logits_bytes(self.device.type, self.activation_budget)
        with self.models.costliest_adapter():
            self.token_cost = microbatches.measure(base, self.device, recompute=self.zero_stage != 3,
                                                   trees=self.packable)
        log.info("a padded token keeps %.1f KiB of activations for the backward (+%.0f bytes per position of the "
                 "longest datum; a rank-%d adapter on every target): --activation-mib %d holds %d tokens of "
                 "512-token datums a micro-batch", self.token_cost.fixed / 1024, self.token_cost.per_position,
                 max_lora_rank, self.activation_budget >> 20,
                 self.token_cost.tokens_within(self.activation_budget, 512))
        if self.token_cost.tree is not None:
            log.info("as token trees: %.1f KiB a tree position, %.1f KiB a datum token (its path's attention)",
                     self.token_cost.tree.per_node / 1024, self.token_cost.tree.per_path_token / 1024)

    # ---- models ---------------------------------------------------------------------------

    def accepts_base_model(self, name: str) -> bool:
        return name in self.base_model_names

    def attach_durable(self, durable: DurableModels) -> None:
        """Where models live when not resident (durable.py); without it nothing can be unloaded."""
        self.durable = durable

    @collective
    def get(self, model_id: str) -> LoraModel:
        """The model; one that is not resident (unloaded, evicted, or from before a restart) is
        reloaded from its durable state first."""
        with self._lock:
            model = self.models.resident(model_id)
            if model is None:
                if not self.on_disk(model_id):
                    raise NotFoundError(f"unknown model_id {model_id!r}")
                model = self.load_state(model_id, self.durable.state_path(model_id), with_optimizer=True,
                                        resume=True)
                log.info("reloaded %s at step %d (seq_id %d)", model_id, model.step, model.state_seq)
                RELOADS.inc()
            model.last_used = time.monotonic()
            return model

    def is_resident(self, model_id: str) -> bool:
        return self.models.resident(model_id) is not None

    def on_disk(self, model_id: str) -> bool:
        """Has durable state to come back from."""
        return self.durable is not None and self.durable.exists(model_id)

    def create_model(self, model_id: str, spec: LoraSpec,
                     initial: dict[str, torch.Tensor] | None = None) -> LoraModel:
        """A new LoRA model; `initial` (PEFT-named adapter tensors) replaces the random init. A
        model that exists already (a resent create) is returned as it is."""
        self.models.check_spec(spec)
        if spec.seed is None:       # drawn once, here: every rank starts from the same weights
            spec = dataclasses.replace(spec, seed=int.from_bytes(os.urandom(4), "little"))
        return self._create_model(model_id, spec, initial)

    @collective
    def _create_model(self, model_id: str, spec: LoraSpec, initial: dict[str, torch.Tensor] | None) -> LoraModel:
        with self._lock:
            if self.is_resident(model_id) or self.on_disk(model_id):
                return self.get(model_id)
            model = self._add(model_id, spec, initial)
            self.save_durable(model_id)       # the random init too: a restart must not re-draw it
            return model

    def _add(self, model_id: str, spec: LoraSpec, initial: dict[str, torch.Tensor] | None, *,
             reuse: bool = False) -> LoraModel:
        self._make_room()
        model = self.models.add(model_id, spec, initial, reuse=reuse)
        model.last_used = time.monotonic()
        return model

    def _make_room(self) -> None:
        """Evicts least recently used models (to their durable state) until one more fits under
        max_resident. Models holding gradients of an unfinished step stay: those would be lost."""
        if self.durable is None:
            return
        while len(self.models.ids()) >= self.max_resident:
            idle = [m for m in self.models.all() if not m.pending_grads]
            if not idle:
                log.warning("%d models resident, all mid-step: over max_resident %d for now",
                            len(self.models.ids()), self.max_resident)
                return
            victim = min(idle, key=lambda m: m.last_used)
            self.unload_model(victim.model_id)
            EVICTIONS.inc()
            log.info("evicted %s (least recently used of %d resident)", victim.model_id, self.max_resident)

    @collective
    def delete_model(self, model_id: str) -> bool:
        """Forgets the model, resident or on disk."""
        with self._lock:
            existed = self.on_disk(model_id)
            if self.durable is not None:
                self.durable.remove(model_id)
            return self.models.remove(model_id) or existed

    @collective
    def unload_model(self, model_id: str) -> str:
        """Frees the model's memory once its durable state is current; the next call that uses it
        reloads it from there, transparently. Returns that directory."""
        with self._lock:
            if self.durable is None:
                raise UserError("this trainer keeps no durable state; nothing can be unloaded")
            if not self.is_resident(model_id):
                if not self.on_disk(model_id):
                    raise NotFoundError(f"unknown model_id {model_id!r}")
                return self.durable.state_path(model_id)
            self.save_durable(model_id)
            # A reload of its shape takes its slot over; not one holding gradients of an unfinished
            # step, which its engine would add to the next owner's.
            pending = self.models.resident(model_id).pending_grads
            self.models.remove(model_id, keep_slot=not pending)
            log.info("unloaded %s", model_id)
            return self.durable.state_path(model_id)

    @collective
    def save_durable(self, model_id: str) -> None:
        """Writes the resident model's durable state, unless it is current already."""
        with self._lock:
            model = self.models.resident(model_id)
            if self.durable is None or model is None or model.durable_seq == model.state_seq:
                return
            self.save_state(model_id, self.durable.state_path(model_id), with_optimizer=True)
            model.durable_seq = model.state_seq
            self.durable.written(model_id)
            self.durable.trim(model_id, model.state_seq)

    def behind(self) -> list[str]:
        """Resident models whose durable state is older than their state."""
        with self._lock:
            return [m.model_id for m in self.models.all() if m.durable_seq != m.state_seq]

    def num_params(self, model: LoraModel) -> int:
        return num_params(model)

    # ---- checkpoints ----------------------------------------------------------------------

    @collective
    def save_state(self, model_id: str, directory: str, *, with_optimizer: bool, age_recipients=()) -> int:
        """Writes the checkpoint atomically (an export encrypted to `age_recipients`, if any);
        returns its size in bytes."""
        with self._lock:
            model = self.get(model_id)
            packed, config = self._packed_adapter(model_id, dtype=None)    # the weights as trained (fp32)
            tmp = self.ranks.agree(checkpoints.temporary_path(directory))
            try:
                if not self.ranks.leader:      # its optimizer partition (collective), nothing else
                    if with_optimizer:
                        checkpoints.write_optimizer(tmp, model, leader=False)
                    return 0
                checkpoints.write_state(tmp, model, packed, config, base_model_dir=self.base_model_dir,
                                        zero_stage=self._stage(model), with_optimizer=with_optimizer,
                                        age_recipients=list(age_recipients))
            except BaseException:
                # Nothing half-written stays beside the last checkpoint: a trainer retrying its
                # durable write on a full disk would otherwise fill it further, write after write.
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            finally:
                packed.release()
        return checkpoints.commit_state(tmp, directory)

    @collective
    def load_state(self, model_id: str, directory: str, *, with_optimizer: bool, resume: bool = False,
                   optimizer: str | None = None) -> LoraModel:
        """Creates `model_id` from a checkpoint: its adapter weights, and with_optimizer its
        optimizer (the checkpoint's), that optimizer's state and the step count too. `optimizer`:
        the new model's (None: AdamW, or with_optimizer the checkpoint's, which it must match).
        `resume`: the checkpoint is this model's own durable state, so it also carries on its
        seq_id count."""
        spec, tensors, step, seq = checkpoints.read_state(directory, with_optimizer=with_optimizer,
                                                          zero_stage=self.zero_stage)
        spec = _with_optimizer(spec, optimizer, restored=with_optimizer, directory=directory)
        self.models.check_spec(spec)
        if with_optimizer:
            self.ranks.check_partitions(os.path.join(directory, checkpoints.OPTIMIZER, "state"))
        with self._lock:
            if self.is_resident(model_id) or (not resume and self.on_disk(model_id)):
                raise UserError(f"model {model_id!r} already exists")
            # The optimizer state is loaded over it next: a spare slot's leftovers never show.
            model = self._add(model_id, spec, tensors, reuse=with_optimizer)
            if with_optimizer:
                try:
                    checkpoints.restore_optimizer(model, directory, step)
                except BaseException:
                    self.models.remove(model_id)     # no half-restored model stays behind
                    raise
            if resume:
                model.state_seq = model.durable_seq = seq
                self.durable.written(model_id)
            else:
                self.save_durable(model_id)
            return model

    @collective
    def export_adapter(self, model_id: str) -> tuple[dict[str, torch.Tensor], dict]:
        """The adapter's full tensors (gathered under ZeRO-3) with PEFT names, and its config."""
        with self._lock:
            return checkpoints.export_adapter(self.peft, self.get(model_id), zero_stage=self.zero_stage,
                                              base_model_dir=self.base_model_dir)

    def snapshot_adapter(self, model_id: str) -> tuple[weight_stream.Packed, dict]:
        """The adapter for a weight push: gathered straight into send chunks in the serving dtype
        (the base model's: a sampler's LoRA dtype follows its model dtype), and its config."""
        return self._packed_adapter(model_id, dtype=self.dtype)

    def _packed_adapter(self, model_id: str, dtype: torch.dtype | None) -> tuple[weight_stream.Packed, dict]:
        """The adapter in weight-stream chunks, cast to `dtype` (None: as trained), and its config;
        call the chunks' `release` once done with them. On one rank it is gathered straight into
        reused chunks with the PEFT names kept per model (adapter_snapshot.py), not through PEFT's
        state-dict walk over every tenant's adapter (docs/benchmarks.md#in-the-trainer)."""
        with self._lock:
            if self.ranks.world > 1:      # every rank joins the gather (ZeRO-3); rank 0 packs what it got
                tensors, config = self.export_adapter(model_id)
                if not self.ranks.leader:     # save_state's followers: only rank 0 writes the adapter
                    return weight_stream.Packed([], []), config
                return weight_stream.pack(tensors, dtype=dtype), config
            model = self.get(model_id)
            packed = adapter_snapshot.gather(self.peft, model, zero_stage=self.zero_stage, dtype=dtype)
            return packed, checkpoints.adapter_config(self.peft, model, self.base_model_dir)

    # ---- training -------------------------------------------------------------------------

    def _stage(self, model: LoraModel) -> int:
        """The ZeRO stage the model's engine runs (a Dimuon model's may be 0 in a ZeRO-1/2 job)."""
        return model_zero_stage(self.zero_stage, model.spec.optimizer)

    @collective
    def forward_backward(self, model_id: str, data: list[training.DatumInput], loss_fn: str,
                         loss_fn_config: dict[str, float], *, forward_only: bool,
                         custom_loss: tuple[str, str] | None = None):
        """Returns (per-datum outputs, metrics). Gradients accumulate until optim_step.
        `custom_loss`: (loss id, its checked spec as JSON) for loss_fn "custom" (custom_loss.py)."""
        scalar_keys: frozenset[str] = frozenset()
        if loss_fn == "custom":
            loss_impl = self.custom_losses.get(model_id, *(custom_loss or ("", "")))
            scalar_keys = frozenset(name for name, rank in loss_impl.spec.inputs[1:] if rank == 0)
        else:
            loss_impl = get_loss(loss_fn)
        training.validate(data, vocab_size=self.vocab_size, max_positions=self.max_positions,
                          max_batch_tokens=self.max_batch_tokens, scalar_keys=scalar_keys)
        if loss_fn == "custom":
            for i, d in enumerate(data):
                loss_impl.check_datum(i, d.loss_fn_inputs, len(d.tokens))
        with self._lock, cores.share().computing():
            model = self.get(model_id)
            shares = self.ranks.share(data)       # data parallel: this rank's part of the batch
            mine = [data[i] for i in shares[self.ranks.rank]]
            # Micro-batches only where a backward keeps activations; every rank knows every share's.
            plans = [[list(range(len(share)))] if share else [] for share in shares] if forward_only else \
                [self._micro_batches([data[i] for i in share]) for share in shares]
            outputs, metrics = training.forward_backward(model, mine, loss_impl, loss_fn_config,
                                                         forward_only=forward_only, device=self.device,
                                                         ranks=self.ranks.world, zero_stage=self._stage(model),
                                                         max_logits_bytes=self.max_logits_bytes,
                                                         groups=plans[self.ranks.rank],
                                                         steps=max(1, *map(len, plans)), packable=self.packable)
            model.pending_grads = model.pending_grads or not forward_only
            outputs, metrics = self.ranks.gather_outputs(data, shares, outputs, metrics)
            if loss_fn == "custom":      # ":mean" metrics came as sums over the datums (and ranks)
                metrics = {k: v / len(data) if k.endswith(":mean") else v for k, v in metrics.items()}
            return outputs, metrics

    def _micro_batches(self, data: list[training.DatumInput]) -> list[list[int]]:
        """Where datums may go as token trees, split in token order, so that datums sharing a
        prefix stay together, each micro-batch priced as the trees it packs into."""
        if not self.packable:
            return microbatches.plan([len(d.tokens) for d in data], self.token_cost, self.activation_budget)
        tokens = [list(d.tokens) for d in data]
        order = sorted(range(len(data)), key=lambda i: tokens[i])
        return microbatches.plan([len(t) for t in tokens], self.token_cost, self.activation_budget, order, tokens)

    @collective
    def optim_step(self, model_id: str, params: training.OptimParams, *, seq: int | None = None) -> dict[str, float]:
        """`params`: AdamParams or DimuonParams, of the optimizer the model was created with.
        `seq`: the request's seq_id, recorded as the last one the model's state includes."""
        if isinstance(params, training.DimuonParams):
            training.check_dimuon(params)
        else:
            training.check_adam(params)
        with self._lock, cores.share().computing():
            model = self.get(model_id)
            given = DIMUON if isinstance(params, training.DimuonParams) else ADAMW
            if given != model.spec.optimizer:
                raise UserError(f"model {model_id} was created with the {model.spec.optimizer} optimizer; "
                                f"optim_step got {PARAMS_CLASS[given]}: send {PARAMS_CLASS[model.spec.optimizer]}")
            metrics = training.optim_step(model, params, zero_stage=self._stage(model), device=self.device,
                                          ranks=self.ranks.world)
            model.pending_grads = False
            model.state_seq = model.step if seq is None else seq
            return metrics


def _with_optimizer(spec: LoraSpec, optimizer: str | None, *, restored: bool, directory: str) -> LoraSpec:
    """A checkpoint's spec with the optimizer of the model made from it: with its optimizer state
    restored, the checkpoint's (a request naming another is refused); else the request's, AdamW
    by default (tinkerd_state.json may name the optimizer that trained the weights: not this one's)."""
    if not restored:
        return dataclasses.replace(spec, optimizer=optimizer or ADAMW)
    if optimizer and optimizer != spec.optimizer:
        raise UserError(f"the checkpoint at {directory} holds {spec.optimizer} optimizer state; a {optimizer} "
                        f"model cannot resume from it: load it without optimizer state, or as a {spec.optimizer} model")
    return spec


def _stage_for_this_job(configured: int) -> int:
    import torch.distributed as dist

    stage = effective_zero_stage(configured, dist.get_world_size())
    if stage != configured:
        log.info("ZeRO-%d on one rank runs as stage %d: nothing to partition", configured, stage)
    return stage
