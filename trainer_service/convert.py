"""Trainer gRPC messages <-> the engine's plain types (the only trainer module knowing both)."""

from __future__ import annotations

import torch

from tinkerd import dtypes, tensors, weight_stream
from tinkerd.errors import UserError
from tinkerd.optimizers import ADAMW, DIMUON
from tinkerd.v1 import common_pb2, sampler_pb2, trainer_pb2
from trainer_service.lora import LoraSpec
from trainer_service.registry import LoraModel
from trainer_service.training import AdamParams, DatumInput, DimuonParams


# The wire's optimizers by the names the engine uses (tinkerd/optimizers.py).
OPTIMIZERS = {common_pb2.OPTIMIZER_ADAMW: ADAMW, common_pb2.OPTIMIZER_DIMUON: DIMUON}


def optimizer(value: int) -> str | None:
    """A CreateModelRequest's optimizer; None where unspecified (the engine decides)."""
    if value == common_pb2.OPTIMIZER_UNSPECIFIED:
        return None
    if value not in OPTIMIZERS:
        raise UserError(f"optimizer {value} is not one this trainer knows: {sorted(OPTIMIZERS)}")
    return OPTIMIZERS[value]


def lora_spec(msg: common_pb2.LoraConfig, optimizer_name: str | None = None) -> LoraSpec:
    return LoraSpec(rank=msg.rank, seed=msg.seed if msg.HasField("seed") else None,
                    train_attn=msg.train_attn, train_mlp=msg.train_mlp, train_unembed=msg.train_unembed,
                    optimizer=optimizer_name or ADAMW)


def model_info(model_id: str, base_model: str, model: LoraModel | None, num_params: int = 0) -> trainer_pb2.ModelInfo:
    """`model` None: unloaded to disk."""
    if model is None:
        return trainer_pb2.ModelInfo(model_id=model_id, base_model=base_model, resident=False)
    s = model.spec
    lora = common_pb2.LoraConfig(rank=s.rank, train_attn=s.train_attn, train_mlp=s.train_mlp,
                                 train_unembed=s.train_unembed)
    if s.seed is not None:
        lora.seed = s.seed
    wire = {name: value for value, name in OPTIMIZERS.items()}
    return trainer_pb2.ModelInfo(model_id=model_id, base_model=base_model, lora_config=lora,
                                 step=model.step, num_params=num_params, resident=True,
                                 optimizer=wire[s.optimizer])


def datum(msg: common_pb2.Datum, index: int) -> DatumInput:
    inputs = {}
    for key, t in msg.loss_fn_inputs.items():
        try:
            inputs[key] = torch.from_numpy(tensors.to_numpy(t).copy())
        except ValueError as e:
            raise UserError(f"datum {index}: loss_fn_inputs[{key!r}]: {e}") from None
    return DatumInput(list(msg.tokens), inputs)


def forward_backward_response(result: tuple[list[dict[str, torch.Tensor]], dict[str, float]]
                              ) -> trainer_pb2.ForwardBackwardResponse:
    """The reply made of TrainerEngine.forward_backward's (per-datum outputs, metrics)."""
    outputs, metrics = result
    return trainer_pb2.ForwardBackwardResponse(
        outputs=[trainer_pb2.DatumOutput(outputs={k: tensors.from_numpy(v.numpy()) for k, v in o.items()})
                 for o in outputs],
        metrics=metrics)


def optim_step_response(metrics: dict[str, float]) -> trainer_pb2.OptimStepResponse:
    return trainer_pb2.OptimStepResponse(metrics=metrics)


def save_state_response(directory: str, size_bytes: int) -> trainer_pb2.SaveStateResponse:
    return trainer_pb2.SaveStateResponse(directory=directory, size_bytes=size_bytes)


def adam_params(msg: common_pb2.AdamParams) -> AdamParams:
    return AdamParams(learning_rate=msg.learning_rate, beta1=msg.beta1, beta2=msg.beta2, eps=msg.eps,
                      weight_decay=msg.weight_decay, grad_clip_norm=msg.grad_clip_norm)


def dimuon_params(msg: common_pb2.DimuonParams) -> DimuonParams:
    return DimuonParams(learning_rate=msg.learning_rate, beta1=msg.beta1, damping=msg.damping,
                        rank_lr_correction_exponent=msg.rank_lr_correction_exponent,
                        grad_clip_norm=msg.grad_clip_norm)


def optim_params(msg: trainer_pb2.OptimStepRequest) -> AdamParams | DimuonParams:
    """An OptimStepRequest's parameters: dimuon_params where set, else adam_params (as every
    caller from before Dimuon sends)."""
    if msg.HasField("dimuon_params"):
        if msg.HasField("adam_params"):
            raise UserError("optim_step takes adam_params or dimuon_params, not both")
        return dimuon_params(msg.dimuon_params)
    return adam_params(msg.adam_params)


def tensor_specs(packed: weight_stream.Packed) -> list[sampler_pb2.TensorSpec]:
    """The manifest's view of a packed adapter's layout."""
    return [sampler_pb2.TensorSpec(name=s.name, dtype=_wire_dtype(s.dtype), shape=s.shape, chunk=s.chunk,
                                   offset=s.offset) for s in packed.specs]


def _wire_dtype(name: str) -> int:
    wire = dtypes.by_name(name).wire
    if wire is None:
        raise ValueError(f"dtype {name} has no tinkerd.v1 DType")
    return wire
