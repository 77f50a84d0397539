from tinkerd.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CheckpointRef(_message.Message):
    __slots__ = ("model_id", "kind", "name")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    kind: str
    name: str
    def __init__(self, model_id: _Optional[str] = ..., kind: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class CreateModelRequest(_message.Message):
    __slots__ = ("model_id", "lora_config", "base_model", "load_checkpoint", "load_optimizer", "optimizer", "after_seq_id")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    LORA_CONFIG_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    LOAD_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    LOAD_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    lora_config: _common_pb2.LoraConfig
    base_model: str
    load_checkpoint: CheckpointRef
    load_optimizer: bool
    optimizer: _common_pb2.Optimizer
    after_seq_id: int
    def __init__(self, model_id: _Optional[str] = ..., lora_config: _Optional[_Union[_common_pb2.LoraConfig, _Mapping]] = ..., base_model: _Optional[str] = ..., load_checkpoint: _Optional[_Union[CheckpointRef, _Mapping]] = ..., load_optimizer: _Optional[bool] = ..., optimizer: _Optional[_Union[_common_pb2.Optimizer, str]] = ..., after_seq_id: _Optional[int] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_id", "base_model", "lora_config", "step", "num_params", "resident", "optimizer")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    LORA_CONFIG_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    base_model: str
    lora_config: _common_pb2.LoraConfig
    step: int
    num_params: int
    resident: bool
    optimizer: _common_pb2.Optimizer
    def __init__(self, model_id: _Optional[str] = ..., base_model: _Optional[str] = ..., lora_config: _Optional[_Union[_common_pb2.LoraConfig, _Mapping]] = ..., step: _Optional[int] = ..., num_params: _Optional[int] = ..., resident: _Optional[bool] = ..., optimizer: _Optional[_Union[_common_pb2.Optimizer, str]] = ...) -> None: ...

class DeleteModelRequest(_message.Message):
    __slots__ = ("model_id",)
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    def __init__(self, model_id: _Optional[str] = ...) -> None: ...

class DeleteModelResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: bool
    def __init__(self, deleted: _Optional[bool] = ...) -> None: ...

class ForwardBackwardRequest(_message.Message):
    __slots__ = ("model_id", "seq_id", "loss_fn", "loss_fn_config", "data", "forward_only", "custom_loss")
    class LossFnConfigEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    LOSS_FN_FIELD_NUMBER: _ClassVar[int]
    LOSS_FN_CONFIG_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    FORWARD_ONLY_FIELD_NUMBER: _ClassVar[int]
    CUSTOM_LOSS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: _containers.ScalarMap[str, float]
    data: _containers.RepeatedCompositeFieldContainer[_common_pb2.Datum]
    forward_only: bool
    custom_loss: CustomLoss
    def __init__(self, model_id: _Optional[str] = ..., seq_id: _Optional[int] = ..., loss_fn: _Optional[str] = ..., loss_fn_config: _Optional[_Mapping[str, float]] = ..., data: _Optional[_Iterable[_Union[_common_pb2.Datum, _Mapping]]] = ..., forward_only: _Optional[bool] = ..., custom_loss: _Optional[_Union[CustomLoss, _Mapping]] = ...) -> None: ...

class CustomLoss(_message.Message):
    __slots__ = ("loss_id", "spec_json")
    LOSS_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    loss_id: str
    spec_json: str
    def __init__(self, loss_id: _Optional[str] = ..., spec_json: _Optional[str] = ...) -> None: ...

class DatumOutput(_message.Message):
    __slots__ = ("outputs",)
    class OutputsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _common_pb2.Tensor
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.MessageMap[str, _common_pb2.Tensor]
    def __init__(self, outputs: _Optional[_Mapping[str, _common_pb2.Tensor]] = ...) -> None: ...

class ForwardBackwardResponse(_message.Message):
    __slots__ = ("outputs", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[DatumOutput]
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, outputs: _Optional[_Iterable[_Union[DatumOutput, _Mapping]]] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class OptimStepRequest(_message.Message):
    __slots__ = ("model_id", "seq_id", "adam_params", "dimuon_params")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    ADAM_PARAMS_FIELD_NUMBER: _ClassVar[int]
    DIMUON_PARAMS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    seq_id: int
    adam_params: _common_pb2.AdamParams
    dimuon_params: _common_pb2.DimuonParams
    def __init__(self, model_id: _Optional[str] = ..., seq_id: _Optional[int] = ..., adam_params: _Optional[_Union[_common_pb2.AdamParams, _Mapping]] = ..., dimuon_params: _Optional[_Union[_common_pb2.DimuonParams, _Mapping]] = ...) -> None: ...

class OptimStepResponse(_message.Message):
    __slots__ = ("metrics",)
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    METRICS_FIELD_NUMBER: _ClassVar[int]
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class PushWeightsRequest(_message.Message):
    __slots__ = ("model_id", "seq_id", "snapshot_id", "sampler_addresses", "persist", "copy_in_background")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    PERSIST_FIELD_NUMBER: _ClassVar[int]
    COPY_IN_BACKGROUND_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    seq_id: int
    snapshot_id: str
    sampler_addresses: _containers.RepeatedScalarFieldContainer[str]
    persist: bool
    copy_in_background: bool
    def __init__(self, model_id: _Optional[str] = ..., seq_id: _Optional[int] = ..., snapshot_id: _Optional[str] = ..., sampler_addresses: _Optional[_Iterable[str]] = ..., persist: _Optional[bool] = ..., copy_in_background: _Optional[bool] = ...) -> None: ...

class PushWeightsResponse(_message.Message):
    __slots__ = ("snapshot_id", "num_bytes", "num_tensors", "gather_seconds", "stream_seconds", "persisted_path", "transports")
    class TransportsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    GATHER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STREAM_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PERSISTED_PATH_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    num_bytes: int
    num_tensors: int
    gather_seconds: float
    stream_seconds: float
    persisted_path: str
    transports: _containers.ScalarMap[str, str]
    def __init__(self, snapshot_id: _Optional[str] = ..., num_bytes: _Optional[int] = ..., num_tensors: _Optional[int] = ..., gather_seconds: _Optional[float] = ..., stream_seconds: _Optional[float] = ..., persisted_path: _Optional[str] = ..., transports: _Optional[_Mapping[str, str]] = ...) -> None: ...

class SaveStateRequest(_message.Message):
    __slots__ = ("model_id", "seq_id", "with_optimizer", "kind", "name", "age_recipients")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    WITH_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    AGE_RECIPIENTS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    seq_id: int
    with_optimizer: bool
    kind: str
    name: str
    age_recipients: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model_id: _Optional[str] = ..., seq_id: _Optional[int] = ..., with_optimizer: _Optional[bool] = ..., kind: _Optional[str] = ..., name: _Optional[str] = ..., age_recipients: _Optional[_Iterable[str]] = ...) -> None: ...

class SaveStateResponse(_message.Message):
    __slots__ = ("directory", "size_bytes")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    directory: str
    size_bytes: int
    def __init__(self, directory: _Optional[str] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class UnloadModelRequest(_message.Message):
    __slots__ = ("model_id",)
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    def __init__(self, model_id: _Optional[str] = ...) -> None: ...

class UnloadModelResponse(_message.Message):
    __slots__ = ("directory",)
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    directory: str
    def __init__(self, directory: _Optional[str] = ...) -> None: ...

class SkipSeqRequest(_message.Message):
    __slots__ = ("model_id", "seq_id", "through_seq_id")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    THROUGH_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    seq_id: int
    through_seq_id: int
    def __init__(self, model_id: _Optional[str] = ..., seq_id: _Optional[int] = ..., through_seq_id: _Optional[int] = ...) -> None: ...

class SkipSeqResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class QueueStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class QueueState(_message.Message):
    __slots__ = ("running_tenant", "queued")
    class QueuedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    RUNNING_TENANT_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    running_tenant: str
    queued: _containers.ScalarMap[str, int]
    def __init__(self, running_tenant: _Optional[str] = ..., queued: _Optional[_Mapping[str, int]] = ...) -> None: ...
