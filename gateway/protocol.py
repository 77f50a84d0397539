"""The Tinker REST API's JSON bodies, one pydantic model per request and response.

Requests ignore fields they do not know (every SDK version sends some we do not use) and treat
an explicit null like an absent field (the SDK leaves None out, other clients send null), so
the defaults below are the API's. A body that does not fit is a 400 naming the field
(gateway/errors.py). The SDK's binary bodies (forward_backward, sample results) are in
gateway/convert.py.
"""

from __future__ import annotations

import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


# ---- sessions ----------------------------------------------------------------------------

class CreateSessionRequest(Body):
    tags: list[str] = []
    user_metadata: dict[str, Any] = {}


class CreateSessionResponse(BaseModel):
    session_id: str
    type: Literal["create_session"] = "create_session"


class SessionHeartbeatRequest(Body):
    session_id: str = ""


# ---- training ----------------------------------------------------------------------------

class LoraConfig(Body):
    rank: int = 32
    seed: int | None = None
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True


class CreateModelRequest(Body):
    session_id: str = ""
    model_seq_id: int = 0
    base_model: str = ""
    lora_config: LoraConfig = LoraConfig()


class ModelIdRequest(Body):
    model_id: str = ""


class FutureResponse(BaseModel):
    """What every call that becomes a future answers at once."""
    model_config = ConfigDict(extra="allow")     # e.g. model_id, sample_sequence_ids
    request_id: str


class ModelData(BaseModel):
    arch: str
    model_name: str
    tokenizer_id: str


class GetInfoResponse(BaseModel):
    type: Literal["get_info"] = "get_info"
    model_id: str
    is_lora: bool = True
    lora_rank: int
    model_name: str
    optimizer_config: dict[str, Any] = {"type": "adamw"}
    model_data: ModelData


class AdamParams(Body):
    type: str = "adam"
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


class OptimStepRequest(Body):
    model_id: str = ""
    seq_id: int = 0
    adam_params: AdamParams | None = None
    optim_params: AdamParams | None = None         # older and non-Adam spellings of the same
    optimizer_params: AdamParams | None = None

    @property
    def params(self) -> AdamParams:
        return self.adam_params or self.optim_params or self.optimizer_params or AdamParams()


class SaveWeightsForSamplerRequest(Body):
    model_id: str = ""
    seq_id: int = 0
    path: str | None = None                        # a name: a named sampler checkpoint
    sampling_session_seq_id: int = 0               # no name: an ephemeral sampling session
    ttl_seconds: int | None = None


class SaveWeightsRequest(Body):
    """save_weights (adapter + optimizer state) and save_weights_external (adapter files)."""
    model_id: str = ""
    seq_id: int = 0
    path: str | None = None
    overwrite: bool = False
    ttl_seconds: int | None = None
    user_metadata: dict[str, Any] = {}


class LoadWeightsRequest(Body):
    """Create-via-load (session_id + model_seq_id) or, legacy, load into model_id."""
    path: str = ""
    optimizer: bool = False
    model_id: str | None = None
    seq_id: int = 0
    session_id: str = ""
    model_seq_id: int = 0


# ---- sampling ----------------------------------------------------------------------------

class PromptChunk(Body):
    type: str = "encoded_text"
    tokens: list[int] = []


class ModelInput(Body):
    chunks: list[PromptChunk] = []


class SamplingParams(Body):
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None


class CreateSamplingSessionRequest(Body):
    session_id: str = ""
    sampling_session_seq_id: int = 0
    model_path: str | None = None
    base_model: str | None = None


class CreateSamplingSessionResponse(BaseModel):
    sampling_session_id: str
    type: Literal["create_sampling_session"] = "create_sampling_session"


class GetSamplerResponse(BaseModel):
    sampler_id: str
    base_model: str
    model_path: str | None = None


class SampleRequest(Body):
    sampling_session_id: str = ""
    seq_id: int = 0
    num_samples: int = 1
    prompt: ModelInput = ModelInput()
    sampling_params: SamplingParams = SamplingParams()
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    prompt_logprobs_last_n: int = 0
    topk_sample_logprobs: int = 0
    prompt_alt_tokens_k: int = 0
    record_stability_info: bool = False


# ---- futures -----------------------------------------------------------------------------

class RetrieveFutureRequest(Body):
    request_id: str = ""


class TryAgainResponse(BaseModel):
    type: Literal["try_again"] = "try_again"
    request_id: str
    queue_state: str
    queue_state_reason: str


# ---- registry (RestClient) ---------------------------------------------------------------

class Cursor(BaseModel):
    offset: int
    limit: int
    total_count: int


class Checkpoint(BaseModel):
    checkpoint_id: str
    checkpoint_type: str
    time: str | None
    tinker_path: str
    size_bytes: int | None
    public: bool
    user_metadata: dict[str, Any] | None
    expires_at: str | None


class CheckpointsResponse(BaseModel):
    checkpoints: list[Checkpoint]
    cursor: Cursor


class TrainingRun(BaseModel):
    training_run_id: str
    base_model: str
    model_owner: str
    is_lora: bool = True
    corrupted: bool = False
    lora_rank: int
    last_request_time: str | None
    last_checkpoint: Checkpoint | None
    last_sampler_checkpoint: Checkpoint | None
    user_metadata: dict[str, Any] | None = None


class TrainingRunsResponse(BaseModel):
    training_runs: list[TrainingRun]
    cursor: Cursor


class SetTtlRequest(Body):
    ttl_seconds: int | None = None


class WeightsInfoRequest(Body):
    tinker_path: str = ""


class WeightsInfoResponse(BaseModel):
    base_model: str
    is_lora: bool = True
    lora_rank: int
    train_unembed: bool
    train_mlp: bool
    train_attn: bool


class ExternalWeightsUrlsResponse(BaseModel):
    urls: dict[str, str]
    expires: str | None


class CopyWeightsRequest(Body):
    source_path: str = ""
    session_id: str | None = None                  # SDK 0.30: a run in this session
    model_seq_id: int = 0
    destination_project_id: str | int | None = None   # SDK 0.38: a new session for the project
    ttl_seconds: int | None = None


class CopyWeightsResponse(BaseModel):
    tinker_path: str


class SessionsResponse(BaseModel):
    sessions: list[str]


class SessionResponse(BaseModel):
    training_run_ids: list[str]
    sampler_ids: list[str]
    user_metadata: dict[str, Any] | None = None


class Page(Body):
    limit: int = Field(100, ge=1, le=10_000)
    offset: int = Field(0, ge=0)


# --- identity ---

class AuthTokenResponse(BaseModel):
    jwt: str


class AuditQuery(Body):
    event_type: Literal["all", "checkpoints", "projects", "teams", "organizations"] = "all"
    day: datetime.date | None = None


class AuditEntry(BaseModel):
    timestamp: str
    event: str
    event_details: dict[str, Any]
    model_id: str | None = None
    tinker_path: str | None = None


class AuditLogResponse(BaseModel):
    entries: list[AuditEntry]
