from tinkerd.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StopReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STOP_REASON_STOP: _ClassVar[StopReason]
    STOP_REASON_LENGTH: _ClassVar[StopReason]
STOP_REASON_STOP: StopReason
STOP_REASON_LENGTH: StopReason

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_mode", "stop_strings", "stop_token_ids")
    class StopMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STOP_MODE_DEFAULT: _ClassVar[SamplingParams.StopMode]
        STOP_MODE_NONE: _ClassVar[SamplingParams.StopMode]
        STOP_MODE_STRINGS: _ClassVar[SamplingParams.StopMode]
        STOP_MODE_TOKENS: _ClassVar[SamplingParams.StopMode]
    STOP_MODE_DEFAULT: SamplingParams.StopMode
    STOP_MODE_NONE: SamplingParams.StopMode
    STOP_MODE_STRINGS: SamplingParams.StopMode
    STOP_MODE_TOKENS: SamplingParams.StopMode
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_MODE_FIELD_NUMBER: _ClassVar[int]
    STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_mode: SamplingParams.StopMode
    stop_strings: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_mode: _Optional[_Union[SamplingParams.StopMode, str]] = ..., stop_strings: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SampleRequest(_message.Message):
    __slots__ = ("request_id", "snapshot_id", "prompt_tokens", "num_samples", "params", "prompt_logprobs", "topk_prompt_logprobs", "prompt_logprobs_last_n", "topk_sample_logprobs", "snapshot_path", "cache_namespace", "prompt_target_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOPK_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_LAST_N_FIELD_NUMBER: _ClassVar[int]
    TOPK_SAMPLE_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_PATH_FIELD_NUMBER: _ClassVar[int]
    CACHE_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TARGET_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    snapshot_id: str
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_samples: int
    params: SamplingParams
    prompt_logprobs: bool
    topk_prompt_logprobs: int
    prompt_logprobs_last_n: int
    topk_sample_logprobs: int
    snapshot_path: str
    cache_namespace: str
    prompt_target_ids: _common_pb2.Tensor
    def __init__(self, request_id: _Optional[str] = ..., snapshot_id: _Optional[str] = ..., prompt_tokens: _Optional[_Iterable[int]] = ..., num_samples: _Optional[int] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., prompt_logprobs: _Optional[bool] = ..., topk_prompt_logprobs: _Optional[int] = ..., prompt_logprobs_last_n: _Optional[int] = ..., topk_sample_logprobs: _Optional[int] = ..., snapshot_path: _Optional[str] = ..., cache_namespace: _Optional[str] = ..., prompt_target_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class TopkLogprobs(_message.Message):
    __slots__ = ("k", "token_ids", "logprobs")
    K_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    k: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, k: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class SampledSequence(_message.Message):
    __slots__ = ("tokens", "logprobs", "stop_reason", "topk_logprobs")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    TOPK_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    stop_reason: StopReason
    topk_logprobs: TopkLogprobs
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., stop_reason: _Optional[_Union[StopReason, str]] = ..., topk_logprobs: _Optional[_Union[TopkLogprobs, _Mapping]] = ...) -> None: ...

class SampleResponse(_message.Message):
    __slots__ = ("sequences", "prompt_logprobs", "topk_prompt_logprobs", "prompt_target_logprobs")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOPK_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TARGET_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[SampledSequence]
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    topk_prompt_logprobs: TopkLogprobs
    prompt_target_logprobs: _common_pb2.Tensor
    def __init__(self, sequences: _Optional[_Iterable[_Union[SampledSequence, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ..., topk_prompt_logprobs: _Optional[_Union[TopkLogprobs, _Mapping]] = ..., prompt_target_logprobs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class WeightManifest(_message.Message):
    __slots__ = ("snapshot_id", "adapter_config_json", "tensors", "chunk_num_bytes", "rendezvous", "persisted_path", "transport", "shared", "sender", "model_id")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_FIELD_NUMBER: _ClassVar[int]
    PERSISTED_PATH_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    adapter_config_json: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    chunk_num_bytes: _containers.RepeatedScalarFieldContainer[int]
    rendezvous: Rendezvous
    persisted_path: str
    transport: str
    shared: SharedWeights
    sender: _common_pb2.WeightEndpoint
    model_id: str
    def __init__(self, snapshot_id: _Optional[str] = ..., adapter_config_json: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., chunk_num_bytes: _Optional[_Iterable[int]] = ..., rendezvous: _Optional[_Union[Rendezvous, _Mapping]] = ..., persisted_path: _Optional[str] = ..., transport: _Optional[str] = ..., shared: _Optional[_Union[SharedWeights, _Mapping]] = ..., sender: _Optional[_Union[_common_pb2.WeightEndpoint, _Mapping]] = ..., model_id: _Optional[str] = ...) -> None: ...

class SharedWeights(_message.Message):
    __slots__ = ("sender", "path", "join", "cuda_handle")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    JOIN_FIELD_NUMBER: _ClassVar[int]
    CUDA_HANDLE_FIELD_NUMBER: _ClassVar[int]
    sender: str
    path: str
    join: bool
    cuda_handle: bytes
    def __init__(self, sender: _Optional[str] = ..., path: _Optional[str] = ..., join: _Optional[bool] = ..., cuda_handle: _Optional[bytes] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape", "chunk", "offset")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: _common_pb2.DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    chunk: int
    offset: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., chunk: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class Rendezvous(_message.Message):
    __slots__ = ("host", "port", "rank", "world_size", "backend", "timeout_seconds", "group", "join")
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    JOIN_FIELD_NUMBER: _ClassVar[int]
    host: str
    port: int
    rank: int
    world_size: int
    backend: str
    timeout_seconds: float
    group: str
    join: bool
    def __init__(self, host: _Optional[str] = ..., port: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., backend: _Optional[str] = ..., timeout_seconds: _Optional[float] = ..., group: _Optional[str] = ..., join: _Optional[bool] = ...) -> None: ...

class SnapshotInfo(_message.Message):
    __slots__ = ("snapshot_id", "num_bytes", "receive_seconds")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    num_bytes: int
    receive_seconds: float
    def __init__(self, snapshot_id: _Optional[str] = ..., num_bytes: _Optional[int] = ..., receive_seconds: _Optional[float] = ...) -> None: ...
