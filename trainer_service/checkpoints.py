"""The adapter in PEFT form, and the checkpoint directory format.

A checkpoint directory: adapter_model.safetensors + adapter_config.json (PEFT format, loadable
by peft and vLLM as they are), tinkerd_state.json (LoRA spec, step), and, for full state,
optimizer/ (a DeepSpeed checkpoint: fp32 master weights + AdamW moments). Directories are
written under a temporary name and renamed into place, so a reader never sees half of one.

Nothing is unpickled beyond tensors: the adapter is safetensors, and DeepSpeed's optimizer files
load with torch.load(weights_only=True), allowing only the three plain-data DeepSpeed types they
hold (a full unpickler would run whatever code a planted file names).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import time

import torch

from tinkerd import weight_stream
from tinkerd.errors import UserError
from trainer_service.lora import LoraSpec
from trainer_service.registry import LoraModel

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
STATE = "tinkerd_state.json"
OPTIMIZER = "optimizer"


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


def write_state(tmp: str, model: LoraModel, tensors: dict[str, torch.Tensor], config: dict, *,
                base_model_dir: str, zero_stage: int, with_optimizer: bool) -> None:
    """The model's checkpoint into the temporary directory `tmp` (see `commit_state`)."""
    write_peft_adapter(tmp, weight_stream.pack(tensors), config)
    meta = {"spec": dataclasses.asdict(model.spec), "step": model.step, "seq": model.state_seq, "base_model": base_model_dir,
            "zero_stage": zero_stage, "has_optimizer": with_optimizer}
    with open(os.path.join(tmp, STATE), "w") as f:
        json.dump(meta, f)
    if with_optimizer:
        write_optimizer(tmp, model)


def write_optimizer(tmp: str, model: LoraModel) -> None:
    """The DeepSpeed optimizer state into `tmp`: collective, each rank writes its partition."""
    model.engine.save_checkpoint(os.path.join(tmp, OPTIMIZER), tag="state",
                                 client_state={"step": model.step}, save_latest=False)


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
    `zero_stage` (the optimizer state only loads under the stage that wrote it)."""
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
    if with_optimizer and meta.get("zero_stage") != zero_stage:
        raise UserError(f"the optimizer state at {directory} was written under ZeRO stage "
                        f"{meta.get('zero_stage')}; this trainer runs stage {zero_stage}")
    return LoraSpec(**meta["spec"]), tensors, int(meta["step"]), int(meta.get("seq", 0))


def _deepspeed_data_types() -> list[type]:
    """What DeepSpeed's ZeRO optimizer files pickle besides tensors and builtins (found with
    torch.serialization.get_unsafe_globals_in_checkpoint on stage 2 and 3 files)."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]


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
            with torch.serialization.safe_globals(_deepspeed_data_types()):
                loaded = torch.load(path, map_location=map_location, weights_only=True)
            self._last = (path, loaded)
            return loaded
    return TensorOnly()


def restore_optimizer(model: LoraModel, directory: str, step: int) -> None:
    """The AdamW state and step count from a full checkpoint, into a model made from it."""
    engine, saved = model.engine, model.engine.checkpoint_engine
    engine.checkpoint_engine = _tensor_only_checkpoint_engine()
    try:
        engine.load_checkpoint(os.path.join(directory, OPTIMIZER), tag="state",
                               load_optimizer_states=True, load_lr_scheduler_states=False)
    except pickle.UnpicklingError as e:
        raise UserError(f"the optimizer state at {directory} holds more than tensors: {str(e)[:200]}") from None
    finally:
        engine.checkpoint_engine = saved
    engine.set_gradient_accumulation_boundary(False)
    model.step = step
