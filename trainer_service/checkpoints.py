"""The adapter in PEFT form, and the checkpoint directory format.

A checkpoint directory: adapter_model.safetensors + adapter_config.json (PEFT format, loadable
by peft and vLLM as they are), tinkerd_state.json (LoRA spec, step), and, for full state,
optimizer/: a stage-0 trainer's (one rank runs ZeRO-1/2 as stage 0) is adamw.safetensors, each
parameter's AdamW moments and step count; a ZeRO-1/2/3 trainer's of several ranks is a DeepSpeed
checkpoint, one optimizer partition per rank. A Dimuon model's (always stage 0: dimuon.py) is
dimuon.safetensors, each parameter's momentum; the spec in tinkerd_state.json names the optimizer
(none named: AdamW, as every checkpoint from before Dimuon). Directories are written under a temporary name and
renamed into place, so a reader never sees half of one.

Why stage 0 writes its own file: DeepSpeed's checkpoint pickles the adapter a second time beside
the moments, and its tensor-only unpickling is pure Python: several times slower to write and
read than the safetensors file (docs/benchmarks.md#in-the-trainer), and a durable write follows
an RL step's optim_step, which the next push waits for.

Optimizer state loads under the ZeRO stage that wrote it, with conversions into stage 0: a
one-rank ZeRO-1/2 checkpoint (from before stage 0, or from a trainer run with keep_zero_stage)
has its flat fp32 moments split by the parameters' sizes, in order; a stage-0 checkpoint of
DeepSpeed's format (written before adamw.safetensors) loads through DeepSpeed.

Nothing is unpickled beyond tensors: the adapter and stage 0's moments are safetensors, and
DeepSpeed's optimizer files load with torch.load(weights_only=True), allowing only the three
plain-data DeepSpeed types they hold (a full unpickler would run whatever code a planted file names).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import time

import torch

from tinkerd import age, weight_stream
from tinkerd.errors import UserError
from tinkerd.optimizers import ADAMW, DIMUON
from trainer_service.deepspeed_setup import model_zero_stage
from trainer_service.lora import LoraSpec
from trainer_service.registry import LoraModel

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
STATE = "tinkerd_state.json"
OPTIMIZER = "optimizer"
ADAMW_STATE = "adamw.safetensors"      # in OPTIMIZER: a stage-0 trainer's moments (module doc)
DIMUON_STATE = "dimuon.safetensors"    # in OPTIMIZER: a Dimuon model's momentum
STATE_FILES = {ADAMW: ADAMW_STATE, DIMUON: DIMUON_STATE}
# Each optimizer's per-parameter state: tensors of their parameter's shape, and scalars.
STATE_KEYS = {ADAMW: (("exp_avg", "exp_avg_sq"), ("step",)), DIMUON: (("momentum",), ())}


def export_adapter(peft_model, model: LoraModel, *, zero_stage: int,
                   base_model_dir: str) -> tuple[dict[str, torch.Tensor], dict]:
    """The adapter's full tensors (gathered under ZeRO-3) with PEFT names, and its config."""
    import deepspeed
    from peft import get_peft_model_state_dict

    with deepspeed.zero.GatheredParameters(model.params, enabled=zero_stage == 3):
        state = get_peft_model_state_dict(peft_model, adapter_name=model.adapter_name, save_embedding_layers=False)
        tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}
    return tensors, adapter_config(peft_model, model, base_model_dir)


def adapter_config(peft_model, model: LoraModel, base_model_dir: str) -> dict:
    """The adapter's adapter_config.json contents."""
    config = peft_model.peft_config[model.adapter_name].to_dict()
    config = json.loads(json.dumps(config, default=lambda o: sorted(o) if isinstance(o, set) else str(o)))
    config["base_model_name_or_path"] = base_model_dir
    return config


def write_peft_adapter(directory: str, packed: weight_stream.Packed, config: dict) -> None:
    """A PEFT-format adapter directory (loadable by peft and by vLLM) from packed tensors:
    the safetensors file is written straight from the chunks."""
    os.makedirs(directory, exist_ok=True)
    weight_stream.write_safetensors(os.path.join(directory, ADAPTER_WEIGHTS), packed)
    with open(os.path.join(directory, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f)


def save_peft_adapter(path: str, packed: weight_stream.Packed, config: dict) -> None:
    """write_peft_adapter, atomically: into a temporary directory, then renamed into place."""
    tmp = temporary_path(path)
    try:
        write_peft_adapter(tmp, packed, config)
        _rename_into_place(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)       # a failed copy leaves nothing half-written behind
        raise


def temporary_path(path: str) -> str:
    """Where to write `path`'s contents before the rename."""
    return f"{path}.partial-{os.getpid()}-{time.monotonic_ns()}"


def _rename_into_place(tmp: str, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    os.replace(tmp, path)


def write_state(tmp: str, model: LoraModel, adapter: weight_stream.Packed, config: dict, *,
                base_model_dir: str, zero_stage: int, with_optimizer: bool, age_recipients: list[str] = ()) -> None:
    """The model's checkpoint into the temporary directory `tmp` (see `commit_state`); with
    `age_recipients`, an export whose files are all encrypted (`write_encrypted`)."""
    meta = {"spec": dataclasses.asdict(model.spec), "step": model.step, "seq": model.state_seq, "base_model": base_model_dir,
            "zero_stage": zero_stage, "has_optimizer": with_optimizer}
    if age_recipients:
        if with_optimizer:
            raise UserError("only an export (save_weights_external) is encrypted, not a training state")
        write_encrypted(tmp, adapter, config, meta, age_recipients)
        return
    write_peft_adapter(tmp, adapter, config)
    with open(os.path.join(tmp, STATE), "w") as f:
        json.dump(meta, f)
    if with_optimizer:
        write_optimizer(tmp, model, leader=True)


def write_encrypted(tmp: str, adapter: weight_stream.Packed, config: dict, meta: dict, recipients: list[str]) -> None:
    """The export's files, each made in memory and written encrypted to `recipients` as
    <name>.age: no plaintext byte of it reaches the disk."""
    import io

    import pyrage

    keys = age.recipients(recipients)
    weights = io.BytesIO()
    weight_stream.write_safetensors(weights, adapter)
    os.makedirs(tmp, exist_ok=True)
    for name, data in ((ADAPTER_WEIGHTS, weights.getbuffer()), (ADAPTER_CONFIG, json.dumps(config).encode()),
                       (STATE, json.dumps(meta).encode())):
        with open(os.path.join(tmp, name + age.SUFFIX), "wb") as out:
            pyrage.encrypt_io(io.BytesIO(data), out, keys)


def write_optimizer(tmp: str, model: LoraModel, *, leader: bool) -> None:
    """The optimizer state into `tmp`. Stage 0: the leader writes adamw.safetensors (or
    dimuon.safetensors; every rank holds the same state). ZeRO-1/2/3: DeepSpeed's checkpoint,
    collective, each rank writes its partition."""
    if model.engine.zero_optimization_stage() == 0:
        if leader:
            _write_moments(os.path.join(tmp, OPTIMIZER, STATE_FILES[model.spec.optimizer]), model)
        return
    model.engine.save_checkpoint(os.path.join(tmp, OPTIMIZER), tag="state",
                                 client_state={"step": model.step}, save_latest=False)


def _write_moments(path: str, model: LoraModel) -> None:
    """The optimizer's per-parameter state (STATE_KEYS), keyed `<name>.<parameter index>` in the
    order of model.params; empty before the first step. Copied: Dimuon's momenta are views of
    one buffer per shape, which safetensors will not write as they are."""
    import safetensors.torch

    state = model.engine.optimizer.state_dict()["state"]
    tensors = {f"{name}.{i}": value.detach().to("cpu", copy=True).contiguous()
               for i, moments in state.items() for name, value in moments.items()}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    safetensors.torch.save_file(tensors, path)


def commit_state(tmp: str, directory: str) -> int:
    """Swaps the written checkpoint in for any old one; returns its size in bytes. The old one is
    renamed aside first and deleted only once the new one is in place, so a crash at any point
    leaves the old or the new one (`recover_swap` puts an old one back), never neither."""
    size = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(tmp) for f in files)
    aside = None
    if os.path.exists(directory):
        aside = f"{directory}{_ASIDE}{time.monotonic_ns()}"
        os.replace(directory, aside)
    _rename_into_place(tmp, directory)
    if aside:
        shutil.rmtree(aside, ignore_errors=True)
    return size


_ASIDE = ".old-"


def recover_swap(directory: str) -> None:
    """After a crash between commit_state's two renames: the old checkpoint back in its place."""
    parent, prefix = os.path.dirname(directory), os.path.basename(directory) + _ASIDE
    if os.path.exists(directory) or not os.path.isdir(parent):
        return
    aside = sorted(n for n in os.listdir(parent) if n.startswith(prefix))
    if aside:
        os.replace(os.path.join(parent, aside[-1]), directory)


def read_state(directory: str, *, with_optimizer: bool,
               zero_stage: int) -> tuple[LoraSpec, dict[str, torch.Tensor], int, int]:
    """A checkpoint's LoRA spec, adapter tensors, step count and last seq_id, checked for loading under
    `zero_stage` (the optimizer state only loads under the stage that wrote it, or converted:
    see the module doc)."""
    import safetensors.torch

    recover_swap(directory)
    try:
        with open(os.path.join(directory, STATE)) as f:
            meta = json.load(f)
        tensors = safetensors.torch.load_file(os.path.join(directory, ADAPTER_WEIGHTS))
    except FileNotFoundError as e:
        raise UserError(f"no checkpoint at {directory}: {e.filename} is missing") from None
    if with_optimizer and not meta.get("has_optimizer"):
        raise UserError(f"the checkpoint at {directory} holds weights only; load it without optimizer state")
    spec = LoraSpec(**meta["spec"])
    saved_stage, zero_stage = meta.get("zero_stage"), model_zero_stage(zero_stage, spec.optimizer)
    if with_optimizer and saved_stage != zero_stage and not _converts(saved_stage, zero_stage):
        hint = " (a trainer of one rank runs ZeRO-1/2 as stage 0)" if saved_stage == 0 else ""
        raise UserError(f"the optimizer state at {directory} was written under ZeRO stage {saved_stage}{hint}; "
                        f"this trainer runs stage {zero_stage}: load it without optimizer state")
    return spec, tensors, int(meta["step"]), int(meta.get("seq", 0))


def _converts(saved_stage, zero_stage: int) -> bool:
    """Whether optimizer state written under `saved_stage` loads under `zero_stage` by conversion
    (one rank's ZeRO-1/2 partition is the whole state; restore_optimizer checks it was one rank)."""
    return saved_stage in (1, 2) and zero_stage == 0


def _deepspeed_data_types() -> list[type]:
    """What DeepSpeed's ZeRO optimizer files pickle besides tensors and builtins (found with
    torch.serialization.get_unsafe_globals_in_checkpoint on stage 2 and 3 files)."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]


def _load_tensors_only(path: str, map_location=None):
    """torch.load allowing tensors, builtins and DeepSpeed's plain-data types, nothing else."""
    with torch.serialization.safe_globals(_deepspeed_data_types()):
        return torch.load(path, map_location=map_location, weights_only=True)


def _tensor_only_checkpoint_engine():
    """DeepSpeed's torch checkpoint engine, loading with weights_only=True (its own passes False)."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class TensorOnly(TorchCheckpointEngine):
        # DeepSpeed reads the model-states file twice in a row (once only to check a count); the
        # second read takes the first's result. Unpickling it tensor-only is pure Python and slow.
        _last: tuple[str, object] | None = None

        def load(self, path: str, map_location=None):
            if self._last is not None and self._last[0] == path:
                loaded, self._last = self._last[1], None
                return loaded
            loaded = _load_tensors_only(path, map_location)
            self._last = (path, loaded)
            return loaded
    return TensorOnly()


# Rank 0's ZeRO-1/2 optimizer partition: the whole state where one rank wrote it.
_FIRST_ZERO_PARTITION = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


def restore_optimizer(model: LoraModel, directory: str, step: int) -> None:
    """The optimizer state and step count from a full checkpoint, into a model made from it."""
    engine = model.engine
    state_dir = os.path.join(directory, OPTIMIZER, "state")
    moments = os.path.join(directory, OPTIMIZER, STATE_FILES[model.spec.optimizer])
    try:
        partition = os.path.join(state_dir, _FIRST_ZERO_PARTITION)
        if os.path.exists(moments):                # read_state let it through to stage 0 only
            _restore_moments(model, moments, directory)
        elif model.spec.optimizer == DIMUON:
            raise UserError(f"the checkpoint at {directory} holds no Dimuon state ({OPTIMIZER}/{DIMUON_STATE})")
        elif engine.zero_optimization_stage() == 0 and os.path.exists(partition):
            _restore_from_zero_partition(model, partition, directory)
        else:
            _restore_with_deepspeed(engine, directory)
    except pickle.UnpicklingError as e:
        raise UserError(f"the optimizer state at {directory} holds more than tensors: {str(e)[:200]}") from None
    engine.set_gradient_accumulation_boundary(False)
    model.step = step


def _restore_moments(model: LoraModel, path: str, directory: str) -> None:
    """adamw.safetensors or dimuon.safetensors into the stage-0 engine's optimizer, each tensor
    checked against its parameter."""
    import safetensors.torch

    try:
        saved = safetensors.torch.load_file(path)
    except Exception as e:          # safetensors raises its own error types for a damaged file
        raise UserError(f"the optimizer state at {directory} is unreadable: {str(e)[:200]}") from None
    shaped, scalars = STATE_KEYS[model.spec.optimizer]
    params, state = model.params, {}
    for key, value in saved.items():
        name, _, index = key.rpartition(".")
        i = int(index) if index.isdigit() else -1
        if name not in shaped + scalars or not 0 <= i < len(params) or \
                tuple(value.shape) != (() if name in scalars else tuple(params[i].shape)):
            raise UserError(f"the optimizer state at {directory} does not fit this adapter "
                            f"({key} of shape {tuple(value.shape)}; {len(params)} parameters here)")
        state.setdefault(i, {})[name] = value       # load_state_dict puts each where its parameter wants it
    width = len(shaped + scalars)
    if state and (len(state) != len(params) or any(len(moments) != width for moments in state.values())):
        raise UserError(f"the optimizer state at {directory} does not fit this adapter "
                        f"({model.spec.optimizer} state of {len(state)} parameters, {len(params)} here)")
    optimizer = model.engine.optimizer
    optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})


def _restore_with_deepspeed(engine, directory: str) -> None:
    saved = engine.checkpoint_engine
    engine.checkpoint_engine = _tensor_only_checkpoint_engine()
    try:
        engine.load_checkpoint(os.path.join(directory, OPTIMIZER), tag="state",
                               load_optimizer_states=True, load_lr_scheduler_states=False)
    finally:
        engine.checkpoint_engine = saved


def _restore_from_zero_partition(model: LoraModel, path: str, directory: str) -> None:
    """A one-rank ZeRO-1/2 optimizer file into the stage-0 engine's AdamW (see the module doc);
    the weights came from the adapter file, which holds the fp32 master weights' values."""
    saved = _load_tensors_only(path, map_location="cpu")["optimizer_state_dict"]
    if saved.get("partition_count") != [1]:
        raise UserError(f"the optimizer state at {directory} was written by a trainer of "
                        f"{saved.get('partition_count')} ranks under ZeRO-{int(saved['zero_stage'])}; "
                        f"this trainer runs one rank at stage 0: load it without optimizer state")
    optimizer = model.engine.optimizer
    optimizer.load_state_dict({"state": _unflatten_moments(saved, model.params, directory),
                               "param_groups": optimizer.state_dict()["param_groups"]})


def _unflatten_moments(saved: dict, params: list[torch.nn.Parameter], directory: str) -> dict[int, dict]:
    """AdamW's per-parameter state from ZeRO's one flat group: exp_avg and exp_avg_sq cut by the
    parameters' sizes in order, past each one's alignment padding; the group's padding at the
    end. Empty when the optimizer never stepped."""
    (flat,) = saved["single_partition_of_fp32_groups"]
    states = list(saved["base_optimizer_state"]["state"].values())
    paddings = saved.get("param_alignment_paddings", [[0] * len(params)])[0]
    used = sum(p.numel() for p in params) + sum(paddings)
    if len(paddings) != len(params) or used + saved["group_paddings"][0] != flat.numel():
        raise UserError(f"the optimizer state at {directory} does not fit this adapter "
                        f"({flat.numel()} values for {len(params)} parameters of {used})")
    if not states:
        return {}
    (state,) = states
    moments, offset = {}, 0
    for i, (p, pad) in enumerate(zip(params, paddings)):
        cut = slice(offset, offset + p.numel())
        moments[i] = {"step": state["step"].clone(), "exp_avg": state["exp_avg"][cut].view_as(p).clone(),
                      "exp_avg_sq": state["exp_avg_sq"][cut].view_as(p).clone()}
        offset += p.numel() + pad
    return moments
