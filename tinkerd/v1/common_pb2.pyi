from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]

class Optimizer(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OPTIMIZER_UNSPECIFIED: _ClassVar[Optimizer]
    OPTIMIZER_ADAMW: _ClassVar[Optimizer]
    OPTIMIZER_DIMUON: _ClassVar[Optimizer]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_INT64: DType
DTYPE_INT32: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT16: DType
OPTIMIZER_UNSPECIFIED: Optimizer
OPTIMIZER_ADAMW: Optimizer
OPTIMIZER_DIMUON: Optimizer

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data", "sparse_csr")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SPARSE_CSR_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    sparse_csr: SparseCsr
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., sparse_csr: _Optional[_Union[SparseCsr, _Mapping]] = ...) -> None: ...

class SparseCsr(_message.Message):
    __slots__ = ("crow_indices", "col_indices")
    CROW_INDICES_FIELD_NUMBER: _ClassVar[int]
    COL_INDICES_FIELD_NUMBER: _ClassVar[int]
    crow_indices: bytes
    col_indices: bytes
    def __init__(self, crow_indices: _Optional[bytes] = ..., col_indices: _Optional[bytes] = ...) -> None: ...

class Datum(_message.Message):
    __slots__ = ("tokens", "loss_fn_inputs")
    class LossFnInputsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Tensor
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FN_INPUTS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    loss_fn_inputs: _containers.MessageMap[str, Tensor]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., loss_fn_inputs: _Optional[_Mapping[str, Tensor]] = ...) -> None: ...

class LoraConfig(_message.Message):
    __slots__ = ("rank", "seed", "train_attn", "train_mlp", "train_unembed")
    RANK_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TRAIN_ATTN_FIELD_NUMBER: _ClassVar[int]
    TRAIN_MLP_FIELD_NUMBER: _ClassVar[int]
    TRAIN_UNEMBED_FIELD_NUMBER: _ClassVar[int]
    rank: int
    seed: int
    train_attn: bool
    train_mlp: bool
    train_unembed: bool
    def __init__(self, rank: _Optional[int] = ..., seed: _Optional[int] = ..., train_attn: _Optional[bool] = ..., train_mlp: _Optional[bool] = ..., train_unembed: _Optional[bool] = ...) -> None: ...

class AdamParams(_message.Message):
    __slots__ = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    GRAD_CLIP_NORM_FIELD_NUMBER: _ClassVar[int]
    learning_rate: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_clip_norm: float
    def __init__(self, learning_rate: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., weight_decay: _Optional[float] = ..., grad_clip_norm: _Optional[float] = ...) -> None: ...

class DimuonParams(_message.Message):
    __slots__ = ("learning_rate", "beta1", "damping", "rank_lr_correction_exponent", "grad_clip_norm")
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    DAMPING_FIELD_NUMBER: _ClassVar[int]
    RANK_LR_CORRECTION_EXPONENT_FIELD_NUMBER: _ClassVar[int]
    GRAD_CLIP_NORM_FIELD_NUMBER: _ClassVar[int]
    learning_rate: float
    beta1: float
    damping: float
    rank_lr_correction_exponent: float
    grad_clip_norm: float
    def __init__(self, learning_rate: _Optional[float] = ..., beta1: _Optional[float] = ..., damping: _Optional[float] = ..., rank_lr_correction_exponent: _Optional[float] = ..., grad_clip_norm: _Optional[float] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("ready", "base_model", "detail", "weight_endpoint")
    READY_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    base_model: str
    detail: str
    weight_endpoint: WeightEndpoint
    def __init__(self, ready: _Optional[bool] = ..., base_model: _Optional[str] = ..., detail: _Optional[str] = ..., weight_endpoint: _Optional[_Union[WeightEndpoint, _Mapping]] = ...) -> None: ...

class WeightEndpoint(_message.Message):
    __slots__ = ("host", "device")
    HOST_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    host: str
    device: str
    def __init__(self, host: _Optional[str] = ..., device: _Optional[str] = ...) -> None: ...
