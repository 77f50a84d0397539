"""TrainerEngine: many LoRA models over one frozen base model, each under its own DeepSpeed engine.

Layout: one PEFT model holds the base and every adapter (named m0, m1, ...). Each LoRA model
gets a DeepSpeed ZeRO engine around an `AdapterModule` holding only its own parameters, with
its own torch AdamW: optimizer state, gradients and step count never mix between models.

Tinker semantics on DeepSpeed: every forward_backward is a micro-step *inside* a gradient-
accumulation window (the boundary is held open), so gradients add up across calls; optim_step
closes the window with a 1-token zero-loss micro-step (which triggers ZeRO's reduction),
steps, and opens a new window. Losses are sums, so DeepSpeed's 1/GAS scaling is turned off.

No gRPC here: the servicer converts messages to the plain types below.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import sys
import threading
import time

import torch

from tinkerd import dtypes, weight_stream
from tinkerd.errors import NotFoundError, UserError
from trainer_service.losses import get_loss
from trainer_service.lora import ACTIVE_MARK, AdapterModule, LoraSpec, linear_groups, peft_config

log = logging.getLogger(__name__)

BASE_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass
class DatumInput:
    tokens: list[int]
    loss_fn_inputs: dict[str, torch.Tensor]


@dataclasses.dataclass
class AdamParams:
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclasses.dataclass
class LoraModel:
    model_id: str
    adapter_name: str
    spec: LoraSpec
    engine: object            # deepspeed.DeepSpeedEngine
    params: list[torch.nn.Parameter]
    step: int = 0


def init_distributed_once() -> None:
    """DeepSpeed's default group; a single process unless launched by a DeepSpeed launcher."""
    import deepspeed
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    if not torch.cuda.is_available():
        # On CPU DeepSpeed JIT-compiles a shared-memory allreduce op at init (35-85 s on a
        # fresh machine). gloo does every collective just as well for our sizes.
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")


def deepspeed_config(zero_stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        # A window that never closes by count: optim_step closes it explicitly.
        "gradient_accumulation_steps": 1 << 30,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": zero_stage},
        "steps_per_print": 1 << 30,
    }


class TrainerEngine:
    def __init__(self, base_model_dir: str, *, zero_stage: int = 2, dtype: str = "float32",
                 max_lora_rank: int = 64, base_model_names: tuple[str, ...] = ()):
        from peft import LoraConfig, get_peft_model
        from transformers import AutoConfig, AutoModelForCausalLM

        if zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0-3, got {zero_stage}")
        if dtype not in BASE_DTYPES:
            raise ValueError(f"dtype must be one of {BASE_DTYPES}, got {dtype!r}")
        init_distributed_once()
        self.base_model_dir = base_model_dir
        self.base_model_names = {base_model_dir, os.path.abspath(base_model_dir), *base_model_names}
        self.zero_stage = zero_stage
        self.max_lora_rank = max_lora_rank
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        config = AutoConfig.from_pretrained(base_model_dir)
        self.vocab_size = config.vocab_size
        self.max_positions = getattr(config, "max_position_embeddings", 1 << 20)
        base = AutoModelForCausalLM.from_pretrained(base_model_dir, dtype=dtypes.torch_dtype(dtype)).to(self.device)
        base.requires_grad_(False)
        self._base = base
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
        # One lock: the PEFT model's active adapter is process-wide state.
        self._lock = threading.RLock()

    # ---- registry -------------------------------------------------------------------------

    def accepts_base_model(self, name: str) -> bool:
        return name in self.base_model_names

    def get(self, model_id: str) -> LoraModel:
        """The model, reloaded from its checkpoint first if it was unloaded."""
        with self._lock:
            model = self._models.get(model_id)
            if model is None and model_id in self._parked:
                path = self._parked.pop(model_id)
                try:
                    model = self.load_state(model_id, path, with_optimizer=True)
                except BaseException:
                    self._parked[model_id] = path
                    raise
                log.info("reloaded %s from %s", model_id, path)
            if model is None:
                raise NotFoundError(f"unknown model_id {model_id!r}")
            return model

    def is_resident(self, model_id: str) -> bool:
        return model_id in self._models

    def model_ids(self) -> tuple[list[str], list[str]]:
        """(resident, unloaded) model ids."""
        with self._lock:
            return list(self._models), list(self._parked)

    def create_model(self, model_id: str, spec: LoraSpec,
                     initial: dict[str, torch.Tensor] | None = None) -> LoraModel:
        """A new LoRA model; `initial` (PEFT-named adapter tensors) replaces the random init."""
        import deepspeed
        from peft import set_peft_model_state_dict

        if not 1 <= spec.rank <= self.max_lora_rank:
            raise UserError(f"LoRA rank must be in 1..{self.max_lora_rank}, got {spec.rank}")
        if not (spec.train_attn or spec.train_mlp or spec.train_unembed):
            raise UserError("at least one of train_attn, train_mlp, train_unembed must be true")
        with self._lock:
            if model_id in self._models or model_id in self._parked:
                return self.get(model_id)
            name = f"m{self._next_adapter}"
            self._next_adapter += 1
            seed = spec.seed if spec.seed is not None else int.from_bytes(os.urandom(4), "little")
            setattr(self.peft, ACTIVE_MARK, None)     # adding/removing adapters moves PEFT's active one
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                self.peft.add_adapter(name, peft_config(self._linear_groups, spec))
            if initial is not None:
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
            params = [p for n, p in self.peft.named_parameters() if f".{name}." in n]
            for p in params:
                p.requires_grad_(True)
            optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
            engine, *_ = deepspeed.initialize(model=AdapterModule(self.peft, name, params),
                                              optimizer=optimizer, config=deepspeed_config(self.zero_stage))
            engine.set_gradient_accumulation_boundary(False)
            model = LoraModel(model_id, name, spec, engine, params)
            self._models[model_id] = model
            log.info("created %s (adapter %s, rank %d, %d params)", model_id, name, spec.rank,
                     self.num_params(model))
            return model

    def delete_model(self, model_id: str) -> bool:
        with self._lock:
            parked = self._parked.pop(model_id, None) is not None
            model = self._models.pop(model_id, None)
            if model is None:
                return parked
            model.engine.destroy()
            setattr(self.peft, ACTIVE_MARK, None)
            self.peft.base_model.delete_adapter(model.adapter_name)
            return True

    def unload_model(self, model_id: str, directory: str) -> str:
        """Frees the model's memory after writing its full state (adapter, optimizer, step) to
        `directory`; the next call that uses it reloads it from there, transparently."""
        with self._lock:
            if model_id in self._parked:
                return self._parked[model_id]
            self.save_state(model_id, directory, with_optimizer=True)
            self.delete_model(model_id)
            self._parked[model_id] = directory
            log.info("unloaded %s to %s", model_id, directory)
            return directory

    # ---- checkpoints ----------------------------------------------------------------------
    # A checkpoint directory: adapter_model.safetensors + adapter_config.json (PEFT format,
    # loadable by peft and vLLM as they are), tinkerd_state.json (LoRA spec, step), and, for
    # full state, optimizer/ (a DeepSpeed checkpoint: fp32 master weights + AdamW moments).

    def save_state(self, model_id: str, directory: str, *, with_optimizer: bool) -> int:
        """Writes the checkpoint atomically; returns its size in bytes."""
        with self._lock:
            model = self.get(model_id)
            tensors, config = self.export_adapter(model_id)
            tmp = f"{directory}.partial-{os.getpid()}-{time.monotonic_ns()}"
            write_peft_adapter(tmp, weight_stream.pack(tensors), config)
            meta = {"spec": dataclasses.asdict(model.spec), "step": model.step,
                    "base_model": self.base_model_dir, "zero_stage": self.zero_stage,
                    "has_optimizer": with_optimizer}
            with open(os.path.join(tmp, "tinkerd_state.json"), "w") as f:
                json.dump(meta, f)
            if with_optimizer:
                model.engine.save_checkpoint(os.path.join(tmp, "optimizer"), tag="state",
                                             client_state={"step": model.step}, save_latest=False)
        size = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(tmp) for f in files)
        if os.path.exists(directory):
            shutil.rmtree(directory)
        os.makedirs(os.path.dirname(os.path.abspath(directory)), exist_ok=True)
        os.replace(tmp, directory)
        return size

    def load_state(self, model_id: str, directory: str, *, with_optimizer: bool) -> LoraModel:
        """Creates `model_id` from a checkpoint: its adapter weights, and with_optimizer its AdamW
        state and step count too."""
        import safetensors.torch

        try:
            with open(os.path.join(directory, "tinkerd_state.json")) as f:
                meta = json.load(f)
            tensors = safetensors.torch.load_file(os.path.join(directory, "adapter_model.safetensors"))
        except FileNotFoundError as e:
            raise UserError(f"no checkpoint at {directory}: {e.filename} is missing") from None
        if with_optimizer and not meta.get("has_optimizer"):
            raise UserError(f"the checkpoint at {directory} holds weights only; load it without optimizer state")
        if with_optimizer and meta.get("zero_stage") != self.zero_stage:
            raise UserError(f"the optimizer state at {directory} was written under ZeRO stage "
                            f"{meta.get('zero_stage')}; this trainer runs stage {self.zero_stage}")
        with self._lock:
            if model_id in self._models:
                raise UserError(f"model {model_id!r} already exists")
            model = self.create_model(model_id, LoraSpec(**meta["spec"]), initial=tensors)
            if with_optimizer:
                model.engine.load_checkpoint(os.path.join(directory, "optimizer"), tag="state",
                                             load_optimizer_states=True, load_lr_scheduler_states=False)
                model.engine.set_gradient_accumulation_boundary(False)
                model.step = int(meta["step"])
            return model

    def num_params(self, model: LoraModel) -> int:
        return sum(int(getattr(p, "ds_numel", p.numel())) for p in model.params)

    # ---- training -------------------------------------------------------------------------

    def _validate(self, data: list[DatumInput]) -> None:
        if not data:
            raise UserError("forward_backward needs at least one datum")
        for i, d in enumerate(data):
            n = len(d.tokens)
            if n == 0:
                raise UserError(f"datum {i}: model_input is empty")
            if n > self.max_positions:
                raise UserError(f"datum {i}: {n} tokens exceed the model's context of {self.max_positions}")
            bad = [t for t in d.tokens if not 0 <= t < self.vocab_size]
            if bad:
                raise UserError(f"datum {i}: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
            for key, t in d.loss_fn_inputs.items():
                if t.dim() == 0 or t.shape[0] != n:
                    raise UserError(f"datum {i}: loss_fn_inputs[{key!r}] has shape {list(t.shape)}, "
                                    f"expected leading dimension {n} (the number of input tokens)")
            targets = d.loss_fn_inputs.get("target_tokens")
            if targets is None:
                raise UserError(f"datum {i}: loss_fn_inputs needs 'target_tokens'")
            if targets.dim() != 1:
                raise UserError(f"datum {i}: target_tokens must be 1-D, got shape {list(targets.shape)}")
            if ((targets < 0) | (targets >= self.vocab_size)).any():
                raise UserError(f"datum {i}: a target token is outside the vocabulary [0, {self.vocab_size})")

    def forward_backward(self, model_id: str, data: list[DatumInput], loss_fn: str,
                         loss_fn_config: dict[str, float], *, forward_only: bool):
        """Returns (per-datum outputs, metrics). Gradients accumulate until optim_step."""
        loss_impl = get_loss(loss_fn)
        self._validate(data)
        with self._lock:
            model = self.get(model_id)
            lengths = [len(d.tokens) for d in data]
            ids = torch.zeros(len(data), max(lengths), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, d in enumerate(data):
                ids[i, :lengths[i]] = torch.tensor(d.tokens)
                mask[i, :lengths[i]] = 1
            ids, mask = ids.to(self.device), mask.to(self.device)
            grad_ctx = torch.no_grad() if forward_only else contextlib.nullcontext()
            with grad_ctx:
                logits = model.engine(ids, mask)
                if logits.dtype != torch.float32:
                    logits = logits.float()
                total = logits.new_zeros((), dtype=torch.float32)
                outputs = []
                for i, d in enumerate(data):
                    inputs = {k: v.to(self.device, torch.float32) if v.is_floating_point() else v.to(self.device)
                              for k, v in d.loss_fn_inputs.items()}
                    targets = inputs["target_tokens"].long()
                    # log p(target) = -cross_entropy: fused, and no (T, vocab) log-softmax kept for backward
                    lp = -torch.nn.functional.cross_entropy(logits[i, :lengths[i]], targets, reduction="none")
                    per_token = loss_impl(lp, inputs, loss_fn_config)
                    total = total + per_token.sum()
                    outputs.append({"logprobs": lp.detach().float().cpu(),
                                    "elementwise_loss": per_token.detach().float().cpu()})
            if not forward_only:
                model.engine.backward(total, scale_wrt_gas=False)
            return outputs, {"loss:sum": float(total.detach())}

    def optim_step(self, model_id: str, adam: AdamParams) -> dict[str, float]:
        if adam.learning_rate < 0 or not (0 <= adam.beta1 < 1 and 0 <= adam.beta2 < 1):
            raise UserError(f"invalid Adam parameters: {adam}")
        with self._lock:
            model = self.get(model_id)
            engine = model.engine
            for group in engine.optimizer.param_groups:
                group.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                             weight_decay=adam.weight_decay)
            engine.optimizer.clip_grad = adam.grad_clip_norm
            engine.set_gradient_accumulation_boundary(True)
            engine.backward(self._closing_loss(model), scale_wrt_gas=False)
            engine.step()
            engine.set_gradient_accumulation_boundary(False)
            model.step += 1
            norm = engine.get_global_grad_norm()
            metrics = {"step:max": float(model.step)}
            if norm is not None:
                metrics["grad_norm:mean"] = float(norm)
            return metrics

    def _closing_loss(self, model: LoraModel) -> torch.Tensor:
        """A zero loss whose backward touches every parameter of the model: the micro-step that
        closes the accumulation window and runs ZeRO's reduction. Under ZeRO-1/2 the parameters
        are whole, so a sum over them does it without running the base model; under ZeRO-3 they
        are partitioned and only a forward gathers them, so that takes a 1-token forward."""
        if self.zero_stage == 3:
            return model.engine(torch.zeros(1, 1, dtype=torch.long, device=self.device)).sum() * 0.0
        model.engine.module.activate()       # PEFT keeps requires_grad only on the active adapter
        return sum(p.sum() for p in model.params) * 0.0

    # ---- export ---------------------------------------------------------------------------

    def export_adapter(self, model_id: str) -> tuple[dict[str, torch.Tensor], dict]:
        """The adapter's full tensors (gathered under ZeRO-3) with PEFT names, and its config."""
        import deepspeed
        from peft import get_peft_model_state_dict

        with self._lock:
            model = self.get(model_id)
            with deepspeed.zero.GatheredParameters(model.params, enabled=self.zero_stage == 3):
                state = get_peft_model_state_dict(self.peft, adapter_name=model.adapter_name,
                                                  save_embedding_layers=False)
                tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}
            config = self.peft.peft_config[model.adapter_name].to_dict()
        config = json.loads(json.dumps(config, default=lambda o: sorted(o) if isinstance(o, set) else str(o)))
        config["base_model_name_or_path"] = self.base_model_dir
        return tensors, config


def write_peft_adapter(directory: str, packed, config: dict) -> None:
    """A PEFT-format adapter directory (loadable by peft and by vLLM) from packed tensors
    (tinkerd.weight_stream.Packed): the safetensors file is written straight from the chunks."""
    os.makedirs(directory, exist_ok=True)
    weight_stream.write_safetensors(os.path.join(directory, "adapter_model.safetensors"), packed)
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
        json.dump(config, f)


def save_peft_adapter(path: str, packed, config: dict) -> None:
    """write_peft_adapter, atomically: into a temporary directory, then renamed into place."""
    tmp = f"{path}.partial-{os.getpid()}-{time.monotonic_ns()}"
    write_peft_adapter(tmp, packed, config)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    os.replace(tmp, path)
