"""The Tinker REST API's JSON bodies, one pydantic model per request and response.

Requests ignore fields they do not know (every SDK version sends some we do not use) and treat
an explicit null like an absent field (the SDK leaves None out, other clients send null), so
the defaults below are the API's. A field of the Tinker API this server does not serve is in its
request's `refused`: asking for it is a 400 that names it, never a request served otherwise
(tests/unit/test_wire_coverage.py holds every field of the SDK's requests to being served here,
refused, or listed there as informational). A body that does not fit is a 400 naming the field
(gateway/errors.py). The SDK's binary bodies (forward_backward, sample results) are in
gateway/convert.py.

Every number and string is bounded here, before anything reaches the database or an engine:
integers fit the 64-bit (or 32-bit) fields they end up in, floats are finite and in the range
the engines accept, and no string carries NUL or a lone surrogate (neither can be stored).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from tinkerd.adam import ADAM_MAX
from tinkerd.optimizers import DIMUON_DEFAULTS, DIMUON_MAX

INT32, INT64 = 2**31 - 1, 2**63 - 1
MAX_JSON_DEPTH = 32
MAX_METADATA_BYTES = 64 << 10          # user_metadata / tags, as JSON
MAX_NUM_SAMPLES = 1024
MAX_TOPK_LOGPROBS = 20                 # vLLM's max_logprobs (its default; the sampler keeps it)
MAX_TARGETS_PER_POSITION = MAX_TOPK_LOGPROBS   # target_prompt_logprobs' ids a prompt position (as top-k)
MAX_TEMPERATURE = 2.0                  # vLLM refuses hotter
MAX_TTL_SECONDS = 100 * 365 * 86400
MAX_STOP = 64
MAX_RETRIEVED_IDS = 65536              # retrieve_futures' acknowledgements in one poll (~2.4 MB of ids)
SAMPLING_CLONE_SPAN = 1_000_000_000    # a SamplingClient clone's seq_ids are clone_id * this + k

SeqId = Annotated[int, Field(ge=0, le=INT64)]
Count32 = Annotated[int, Field(ge=0, le=INT32)]
Seed = Annotated[int, Field(ge=-INT64 - 1, le=INT64)]
Id = Annotated[str, Field(max_length=1024)]
Ttl = Annotated[int, Field(ge=1, le=MAX_TTL_SECONDS)]
Token = Annotated[int, Field(ge=0, le=INT32)]


def _bad_text(s: str) -> str | None:
    if "\x00" in s:
        return "contains a NUL character"
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            return "is not valid Unicode (a lone surrogate)"
    return None


def check_json(value: Any, where: str = "") -> None:
    """Refuses what JSON text can carry but nothing here can store or use: NaN and infinities,
    integers beyond 64 bits, NUL and lone surrogates in strings (keys too), deep nesting."""
    stack = [(value, where or "body", 0)]
    while stack:
        v, path, depth = stack.pop()
        if isinstance(v, str):
            problem = _bad_text(v)
        elif isinstance(v, float):
            problem = None if math.isfinite(v) else f"is {v}; numbers must be finite"
        elif isinstance(v, int):
            problem = None if -INT64 - 1 <= v <= INT64 else "is an integer beyond 64 bits"
        elif isinstance(v, (dict, list)):
            problem = f"is nested deeper than {MAX_JSON_DEPTH}" if depth >= MAX_JSON_DEPTH else None
            for key in v if isinstance(v, dict) else ():
                if _bad_text(key):
                    raise ValueError(f"{path}: the key {key!r} {_bad_text(key)}")
            for key, x in (v.items() if isinstance(v, dict) else enumerate(v)):
                if type(x) is int and -INT64 - 1 <= x <= INT64:
                    continue                  # the common case (token lists): no path string made
                stack.append((x, f"{key}" if path == "body" else f"{path}.{key}", depth + 1))
        else:
            problem = None
        if problem:
            raise ValueError(f"{path} {problem}")


def _small_json(value: Any, where: str) -> Any:
    size = len(json.dumps(value))
    if size > MAX_METADATA_BYTES:
        raise ValueError(f"{where} is {size} bytes as JSON; at most {MAX_METADATA_BYTES}")
    return value


def string_values(metadata: dict[str, Any]) -> dict[str, str]:
    """user_metadata as the SDK reads it back (dict[str, str]): a non-string value is kept as its
    JSON text, so listing runs and checkpoints never fails in the SDK's response validation."""
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()}


def parse_json(raw: bytes) -> Any:
    """A body read by hand (retrieve_future): anything that is not JSON is the client's error."""
    from tinkerd.errors import UserError
    try:
        return json.loads(raw)
    except RecursionError:
        raise UserError("the JSON body is nested too deeply") from None
    except ValueError as e:              # JSONDecodeError, UnicodeDecodeError, over-long integers
        raise UserError(f"the request body is not valid JSON: {e}") from None


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


@dataclasses.dataclass(frozen=True)
class NotServed:
    """A field of the Tinker API this server does not serve, and why. A request asks for it with
    any value but null, `default` (what the SDK sends when its caller asks for nothing) or an
    empty list or object."""
    why: str
    default: Any = None

    def asked(self, value: Any) -> bool:
        return value is not None and value != self.default and value not in ([], {})


class Request(Body):
    """A whole request body: checked as JSON once (check_json), then field by field. `refused`:
    its fields this server does not serve, by name; a request that asks for one is refused."""
    refused: ClassVar[dict[str, NotServed]] = {}

    @model_validator(mode="before")
    @classmethod
    def _plain_json(cls, data: Any) -> Any:
        check_json(data)
        if isinstance(data, dict):
            for name, field in cls.refused.items():
                if field.asked(data.get(name)):
                    raise ValueError(f"{name} is not served by this server: {field.why}")
        return data


AccessToken = Annotated[str, Field(max_length=256)]     # gateway/access_tokens.py


# ---- sessions ----------------------------------------------------------------------------

ProjectId = Annotated[str, Field(max_length=128)]         # gateway/projects.py checks its form
DisplayName = Annotated[str, Field(max_length=512)]


class CreateSessionRequest(Request):
    tags: list[Annotated[str, Field(max_length=256)]] = Field([], max_length=64)
    user_metadata: dict[str, Any] = {}
    project_id: ProjectId | None = None        # None: the caller's default project
    display_name: DisplayName | None = None

    @model_validator(mode="after")
    def _small(self):
        _small_json(self.user_metadata, "user_metadata")
        self.user_metadata = string_values(self.user_metadata)
        return self


class CreateSessionResponse(BaseModel):
    session_id: str
    type: Literal["create_session"] = "create_session"


class SessionHeartbeatRequest(Request):
    session_id: Id = ""


class FinishReason(Body):
    type: Literal["success", "errored", "interrupted"] = "success"


class FinishSessionRequest(Request):
    """ServiceClient.close(status, detail): kept as the session's status (search_sessions)."""
    reason: FinishReason | None = None
    detail: Annotated[str, Field(max_length=4096)] | None = None


class AssignProjectRequest(Request):
    project_id: ProjectId = ""


class OwnSearchOwner(Body):
    model_config = ConfigDict(extra="forbid")
    type: Literal["own"] = "own"


class AccessibleSearchOwner(Body):
    model_config = ConfigDict(extra="forbid")
    type: Literal["accessible"] = "accessible"


class UserSearchOwner(Body):
    model_config = ConfigDict(extra="forbid")
    type: Literal["user"] = "user"
    owner_urns: list[Id] = Field(min_length=1, max_length=10)


class StatusQuery(Body):
    """One of SessionStatusQuery's kinds; `reasons` only with client_finished."""
    model_config = ConfigDict(extra="forbid")
    type: Literal["active", "cancelled", "failed", "client_finished"]
    reasons: list[Literal["success", "errored", "interrupted"]] | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _reasons_only_when_finished(self):
        if self.reasons is not None and self.type != "client_finished":
            raise ValueError(f"reasons go with type client_finished, not {self.type}")
        return self


class SearchCursor(Body):
    model_config = ConfigDict(extra="forbid")
    last_created_at: datetime.datetime
    last_session_id: Id

    @field_validator("last_created_at")
    @classmethod
    def _aware(cls, v: datetime.datetime) -> datetime.datetime:
        if v.tzinfo is None:
            raise ValueError("must carry a time zone (pass next_cursor back unchanged)")
        return v.astimezone(datetime.timezone.utc)


class SessionSearchRequest(Request):
    """SDK 0.38's SessionSearchRequest (gateway/session_search.py runs it)."""
    session_id: Id | None = None
    project_ids: list[ProjectId] | None = Field(None, max_length=100)
    user_metadata: dict[Annotated[str, Field(max_length=256)], Annotated[str, Field(max_length=4096)]] = \
        Field({}, max_length=32)
    display_name: DisplayName | None = Field(None, min_length=1)
    owner: Annotated[OwnSearchOwner | AccessibleSearchOwner | UserSearchOwner, Field(discriminator="type")] = \
        OwnSearchOwner()
    statuses: list[StatusQuery] | None = Field(None, min_length=1, max_length=16)
    limit: int = Field(50, ge=1, le=200)
    cursor: SearchCursor | None = None


class SessionSummary(BaseModel):
    session_id: str
    created_at: str
    owner: str
    project_id: str
    status: dict[str, Any] | None = None
    checkpoints_count: int
    display_name: str | None = None
    user_metadata: dict[str, str] | None = None
    checkpoint_storage_bytes: int | None = None


class SessionSearchResponse(BaseModel):
    sessions: list[SessionSummary]
    next_cursor: dict[str, str] | None = None


# ---- training ----------------------------------------------------------------------------

class LoraConfig(Body):
    rank: int = Field(32, ge=1, le=INT32)        # and at most the server's --max-lora-rank (routes/training.py)
    seed: Seed | None = None
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True


class OptimizerConfig(Body):
    """The optimizer a model is created with, fixed for its life (tinkerd/optimizers.py). An
    unknown type, or a field this server does not know, is a 400: it would not be honoured."""
    model_config = ConfigDict(extra="forbid")
    type: Literal["adamw", "dimuon"] = "adamw"
    version: Literal[1] = 1


def optimizer_config(name: str) -> dict[str, Any]:
    """A model's optimizer as the SDK's OptimizerConfig (get_info, weights_info)."""
    return {"type": "dimuon", "version": 1} if name == "dimuon" else {"type": "adamw"}


class CreateModelRequest(Request):
    session_id: Id = ""
    model_seq_id: SeqId = 0
    base_model: Id = ""
    lora_config: LoraConfig = LoraConfig()
    optimizer_config: OptimizerConfig = OptimizerConfig()


class ModelIdRequest(Request):
    model_id: Id = ""


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
    """Finite (allow_inf_nan=False) and in Adam's domain: a NaN or negative step would be taken
    and leave every weight of the adapter NaN; above ADAM_MAX (tinkerd/adam.py) a typo would blow
    the weights up."""
    type: Id = "adam"
    learning_rate: float = Field(1e-4, ge=0, le=ADAM_MAX["learning_rate"])
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-12, gt=0, le=ADAM_MAX["eps"])    # 0 divides 0 by 0 where a gradient is 0
    weight_decay: float = Field(0.0, ge=0, le=ADAM_MAX["weight_decay"])
    grad_clip_norm: float = Field(0.0, ge=0)


class DimuonParams(Body):
    """One Dimuon step (trainer_service/dimuon.py), bounded as AdamParams (tinkerd/optimizers.py).
    The defaults are Tinker's for what an older SDK leaves out; a field this server does not know
    (weight_decay, say) is a 400, not dropped."""
    model_config = ConfigDict(extra="forbid")
    type: Literal["dimuon"] = "dimuon"
    learning_rate: float = Field(ge=0, le=DIMUON_MAX["learning_rate"])
    grad_clip_norm: float = DIMUON_DEFAULTS["grad_clip_norm"]     # nonpositive: no clipping (the SDK's doc)
    beta1: float = Field(DIMUON_DEFAULTS["beta1"], ge=0, lt=1)
    damping: float = Field(DIMUON_DEFAULTS["damping"], gt=0, le=DIMUON_MAX["damping"])
    rank_lr_correction_exponent: float = Field(DIMUON_DEFAULTS["rank_lr_correction_exponent"],
                                               ge=-DIMUON_MAX["rank_lr_correction_exponent"],
                                               le=DIMUON_MAX["rank_lr_correction_exponent"])


class OptimStepRequest(Request):
    model_id: Id = ""
    seq_id: SeqId = 0
    adam_params: AdamParams | DimuonParams | None = None
    optim_params: AdamParams | DimuonParams | None = None       # older and non-Adam spellings of the same
    optimizer_params: AdamParams | DimuonParams | None = None

    @field_validator("adam_params", "optim_params", "optimizer_params", mode="wrap")
    @classmethod
    def _by_type(cls, value: Any, handler) -> AdamParams | DimuonParams:
        """DimuonParams where `type` says "dimuon", else AdamParams (the SDK sends those without a
        type); an error names the field as sent (adam_params.learning_rate), not a union member."""
        kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
        return (DimuonParams if kind == "dimuon" else AdamParams).model_validate(value)

    @property
    def params(self) -> AdamParams | DimuonParams:
        return self.adam_params or self.optim_params or self.optimizer_params or AdamParams()


class SaveWeightsForSamplerRequest(Request):
    model_id: Id = ""
    seq_id: SeqId = 0
    path: Id | None = None                         # a name: a named sampler checkpoint
    sampling_session_seq_id: SeqId = 0             # no name: an ephemeral sampling session
    # snapshot: fixed weights; inflight: the model's shared weights, which later inflight saves
    # update (the contract: SDK 0.38 types/sampling_client_kind.py)
    kind: Literal["snapshot", "inflight"] = "snapshot"
    ttl_seconds: Ttl | None = None


class SaveWeightsRequest(Request):
    """save_weights (adapter + optimizer state) and save_weights_external (adapter files; with
    age_encryption_recipients each written encrypted to them, tinkerd/age.py)."""
    model_id: Id = ""
    seq_id: SeqId = 0
    path: Id | None = None
    overwrite: bool = False
    ttl_seconds: Ttl | None = None
    user_metadata: dict[str, Any] = {}
    age_encryption_recipients: list[Annotated[str, Field(max_length=16384)]] | None = Field(None, max_length=64)

    @model_validator(mode="after")
    def _small(self):
        _small_json(self.user_metadata, "user_metadata")
        self.user_metadata = string_values(self.user_metadata)
        return self


class LoadWeightsRequest(Request):
    """Create-via-load (session_id + model_seq_id) or, legacy, load into model_id."""
    refused = {"base_model": NotServed("a checkpoint loads on the base model it was trained on: leave "
                                       "base_model unset")}
    path: Id = ""
    optimizer: bool = False
    model_id: Id | None = None
    seq_id: SeqId = 0
    session_id: Id = ""
    model_seq_id: SeqId = 0
    optimizer_config: OptimizerConfig | None = None   # a new weights-only model's; None: AdamW
    weights_access_token: AccessToken | None = None     # another user's checkpoint, granted by its owner


# ---- sampling ----------------------------------------------------------------------------

class PromptChunk(Body):
    type: Id = "encoded_text"
    tokens: list[Token] = []


class ModelInput(Body):
    chunks: list[PromptChunk] = []


class SamplingParams(Body):
    """In the ranges vLLM accepts; token ids against the vocabulary and max_tokens against the
    context are checked with the model's limits (convert.check_sample)."""
    max_tokens: int | None = Field(None, ge=1, le=INT32)
    temperature: float = Field(1.0, ge=0, le=MAX_TEMPERATURE)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, le=INT32)
    seed: Seed | None = None
    stop: str | list[str] | list[int] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        items = [v] if isinstance(v, str) else v
        if not isinstance(items, list) or len(items) > MAX_STOP:
            raise ValueError(f"must be a string, or a list of at most {MAX_STOP} strings or token ids")
        if all(isinstance(x, str) for x in items):
            if not all(0 < len(x) <= 1024 for x in items):
                raise ValueError("a stop string must be 1..1024 characters (vLLM refuses an empty one)")
        elif all(type(x) is int for x in items):
            if not all(0 <= x <= INT32 for x in items):
                raise ValueError("a stop token id must be a token id (>= 0)")
        else:
            raise ValueError("must be all strings or all token ids")
        return v


class CreateSamplingSessionRequest(Request):
    session_id: Id = ""
    sampling_session_seq_id: SeqId = 0
    model_path: Id | None = None
    base_model: Id | None = None


class CreateSamplingSessionResponse(BaseModel):
    sampling_session_id: str
    type: Literal["create_sampling_session"] = "create_sampling_session"


class GetSamplerResponse(BaseModel):
    sampler_id: str
    base_model: str
    model_path: str | None = None


class TargetTokens(Body):
    """SampleRequest.target_prompt_logprobs (the SDK's TensorData): int64 token ids of shape
    [len(prompt) - 1, K], dense or sparse CSR (a cell not listed asks for nothing, as does -1).
    Checked here: its layout, at least one id, at most MAX_TARGETS_PER_POSITION a position; its
    rows against the prompt in SampleRequest, its ids against the vocabulary in
    convert.check_sample. `ids`, `crow` and `col` hold it as arrays (made here, off the event loop)."""
    data: list[Annotated[int, Field(ge=-1, le=INT32)]] = []
    dtype: Literal["int64"]
    shape: list[Count32] = Field(min_length=2, max_length=2)
    sparse_crow_indices: list[Annotated[int, Field(ge=0, le=INT64)]] | None = None
    sparse_col_indices: list[Annotated[int, Field(ge=0, le=INT64)]] | None = None
    _ids: Any = PrivateAttr(None)
    _crow: Any = PrivateAttr(None)
    _col: Any = PrivateAttr(None)

    @model_validator(mode="after")
    def _layout(self):
        from tinkerd import tensors

        rows, width = self.shape
        ids = np.asarray(self.data, dtype=np.int64)
        if (self.sparse_crow_indices is None) != (self.sparse_col_indices is None):
            raise ValueError("sparse_crow_indices and sparse_col_indices come together (a CSR tensor)")
        if self.sparse_crow_indices is not None:
            crow = np.asarray(self.sparse_crow_indices, dtype="<i8")
            col = np.asarray(self.sparse_col_indices, dtype="<i8")
            row_of, _ = tensors.csr_indices(crow.tobytes(), col.tobytes(), len(ids), (rows, width))
            self._crow, self._col = crow, col
        elif len(ids) != rows * width:
            raise ValueError(f"{len(ids)} values do not fill shape {self.shape}")
        else:
            row_of = np.repeat(np.arange(rows), width)
        if not (ids >= 0).any():
            raise ValueError("names no token id (every cell is -1 or unlisted)")
        per_row = np.bincount(row_of[ids >= 0], minlength=rows)
        if per_row.max() > MAX_TARGETS_PER_POSITION:
            raise ValueError(f"names {per_row.max()} token ids at prompt position {int(per_row.argmax()) + 1}; "
                             f"at most {MAX_TARGETS_PER_POSITION} a position (as topk_prompt_logprobs)")
        self._ids = ids
        return self

    @property
    def ids(self) -> np.ndarray:
        return self._ids

    @property
    def crow(self) -> np.ndarray | None:
        return self._crow

    @property
    def col(self) -> np.ndarray | None:
        return self._col


class SampleRequest(Request):
    refused = {"prompt_alt_tokens_k": NotServed("draws of alternative prompt tokens are not served: ask for "
                                                "topk_prompt_logprobs (the most likely tokens at each prompt "
                                                "position), or sample from a prompt cut at that position",
                                                default=0)}
    sampling_session_id: Id = ""
    seq_id: SeqId = 0
    num_samples: int = Field(1, ge=1, le=MAX_NUM_SAMPLES)
    prompt: ModelInput = ModelInput()
    sampling_params: SamplingParams = SamplingParams()
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = Field(0, ge=0, le=MAX_TOPK_LOGPROBS)
    prompt_logprobs_last_n: Annotated[int, Field(ge=1, le=INT32)] | None = None    # None: every position
    topk_sample_logprobs: int = Field(0, ge=0, le=MAX_TOPK_LOGPROBS)
    target_prompt_logprobs: TargetTokens | None = None
    record_stability_info: bool = False

    @model_validator(mode="after")
    def _prompt_scoring(self):
        """What names prompt positions fits the prompt (SDK 0.38's SampleRequest docstrings)."""
        length = sum(len(c.tokens) for c in self.prompt.chunks)
        if self.prompt_logprobs_last_n is not None:
            if not self.prompt_logprobs:
                raise ValueError("prompt_logprobs_last_n scores prompt logprobs: set prompt_logprobs "
                                 "(include_prompt_logprobs=True)")
            if self.prompt_logprobs_last_n > length - 1:
                raise ValueError(f"prompt_logprobs_last_n is {self.prompt_logprobs_last_n}; a prompt of {length} "
                                 f"tokens has {length - 1} positions to score (the first has no context)")
        targets = self.target_prompt_logprobs
        if targets is not None and targets.shape[0] != length - 1:
            raise ValueError(f"target_prompt_logprobs has shape {targets.shape}; a prompt of {length} tokens "
                             f"takes [len(prompt) - 1, K] = [{length - 1}, K]")
        return self


# ---- futures -----------------------------------------------------------------------------

class JoinSamplingSessionRequest(Request):
    sampling_session_id: Id
    type: Literal["join_sampling_session"] = "join_sampling_session"


class RetrieveFutureRequest(Request):
    request_id: Id = ""
    # The SDK's permission to answer a large result with its size first (it reserves the memory,
    # then asks again without it).
    allow_metadata_only: bool = False


class TryAgainResponse(BaseModel):
    type: Literal["try_again"] = "try_again"
    request_id: str
    queue_state: str
    queue_state_reason: str


class SamplingSessionTarget(Body):
    """Whose completions retrieve_futures reports: one sampling session, and one clone of its
    SamplingClient (an unpickled copy numbers its seq_ids from clone_id * 1e9)."""
    type: Literal["sampling_session"] = "sampling_session"
    sampling_session_id: Id = ""
    cloned_sampler_id: int = Field(0, ge=0, le=INT64 // SAMPLING_CLONE_SPAN)


class RetrieveFuturesRequest(Request):
    """SDK >= 0.28 with sample_use_retrieve_futures: one long-poll per sampling session for its
    finished samples. 0.28-0.35 send neither `timeout` nor `retrieved_request_ids`."""
    target: SamplingSessionTarget
    prev_cursor: int = Field(0, ge=0, le=INT64)
    timeout: float | None = Field(None, ge=0)       # None: the server's long-poll; 0: answer at once
    retrieved_request_ids: list[Id] = []

    @field_validator("retrieved_request_ids", mode="before")
    @classmethod
    def _bounded(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) > MAX_RETRIEVED_IDS:
            raise ValueError(f"has {len(v)} request ids; at most {MAX_RETRIEVED_IDS} per retrieve_futures call")
        return v


class FutureCompletion(BaseModel):
    state: Literal["finished", "failed"]
    request_id: str
    response_payload_uncompressed_size: int | None = None     # finished only: the SDK reserves it


class RetrieveFuturesResponse(BaseModel):
    completions: list[FutureCompletion]
    cursor: int


class CancelFutureRequest(Request):
    request_id: Id = ""


class CancelFutureResponse(BaseModel):
    """The SDK reads no body (any 2xx). `cancelled` says whether this call cancelled it; `status`
    is where the future is now."""
    request_id: str
    cancelled: bool
    status: Literal["cancelled", "complete", "failed"]


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


class SetTtlRequest(Request):
    ttl_seconds: Ttl | None = None


class WeightsInfoRequest(Request):
    tinker_path: Id = ""


class WeightsInfoResponse(BaseModel):
    base_model: str
    optimizer_config: dict[str, Any] = {"type": "adamw"}
    is_lora: bool = True
    lora_rank: int
    train_unembed: bool
    train_mlp: bool
    train_attn: bool


class ExternalWeightsUrlsResponse(BaseModel):
    urls: dict[str, str]
    expires: str | None


class CopyWeightsRequest(Request):
    """SDK 0.38 sends its weights_access_token as the X-Tinker-Weights-Access-Token header."""
    weights_access_token: AccessToken | None = None
    source_path: Id = ""
    session_id: Id | None = None                   # SDK 0.30: a run in this session
    model_seq_id: SeqId = 0
    destination_project_id: Id | int | None = None    # SDK 0.38: a new session for the project
    ttl_seconds: Ttl | None = None


class CopyWeightsResponse(BaseModel):
    tinker_path: str


class MintAccessTokenRequest(Request):
    """POST /weights_access_tokens: a token for one of the caller's checkpoints (gateway/access_tokens.py)."""
    tinker_path: Id = ""
    ttl_seconds: Ttl | None = None


class AccessTokensQuery(Body):
    tinker_path: Id | None = None


class SessionsResponse(BaseModel):
    sessions: list[str]


class SessionResponse(BaseModel):
    training_run_ids: list[str]
    sampler_ids: list[str]
    user_metadata: dict[str, Any] | None = None
    display_name: str | None = None
    project_id: str | None = None


class Page(Body):
    limit: int = Field(100, ge=1, le=10_000)
    offset: int = Field(0, ge=0, le=INT64)


class RunsPage(Page):
    """list_training_runs' query: `project_id` keeps the runs of that project's sessions."""
    project_id: ProjectId | None = None


# ---- usage (AdminClient) -----------------------------------------------------------------

class UsageWindow(Body):
    """GET /billing/usage/events' query; gateway/billing.py checks the window."""
    starting_on: datetime.datetime
    ending_before: datetime.datetime


class StorageQuery(Body):
    project_id: ProjectId | None = None


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
