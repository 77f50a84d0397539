"""REST <-> gRPC: the one module that knows both the Tinker SDK's bodies and our gRPC messages.

In: the SDK's JSON bodies (as gateway/protocol.py models) and its binary forward_backward body
(application/x-protobuf, maybe zstd) become tinkerd.v1 requests. Out: trainer and sampler
replies become the SDK's binary results. What the SDK can send but we cannot serve (images,
audio) is refused here with a user error.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os

import numpy as np

from gateway import protocol
from gateway import tinker_wire_pb2 as tw
from gateway.settings import GatewaySettings
from gateway.stability import Span
from tinkerd import dtypes, tensors
from tinkerd.errors import UserError
from tinkerd.optimizers import ADAMW, DIMUON, PARAMS_CLASS
from tinkerd.tensors import from_numpy, to_numpy
from tinkerd.v1 import common_pb2, sampler_pb2, trainer_pb2

DEFAULT_MAX_TOKENS = 128
MAX_BODY_BYTES = GatewaySettings.max_body_bytes
MAX_DATUMS = 1024                  # the SDK's fwdbwd_max_chunk_len: it never sends more at once
MAX_BATCH_TOKENS = GatewaySettings.max_batch_tokens     # datums x longest datum
_Stop = sampler_pb2.SamplingParams.StopMode


class BodyTooLarge(UserError):
    """More bytes than the gateway takes (HTTP 413)."""


def decompress(body: bytes, content_encoding: str | None, max_bytes: int = MAX_BODY_BYTES) -> bytes:
    """A zstd body inflated, never to more than `max_bytes` (a 2 KB bomb can hold gigabytes)."""
    if not (content_encoding and "zstd" in content_encoding.lower()):
        return body
    import zstandard
    out, size = [], 0
    try:
        with zstandard.ZstdDecompressor().stream_reader(body, read_across_frames=True) as reader:
            while chunk := reader.read(1 << 20):
                size += len(chunk)
                if size > max_bytes:
                    raise BodyTooLarge(f"the zstd body inflates to more than {max_bytes} bytes")
                out.append(chunk)
    except zstandard.ZstdError as e:
        raise UserError(f"the body is not valid zstd: {e}") from None
    return b"".join(out)


# ---- limits of the base model: vocabulary and context --------------------------------------

@dataclasses.dataclass(frozen=True)
class ModelLimits:
    vocab_size: int | None           # None: unknown (no config.json), left to the engines
    max_positions: int | None        # the trainer's context (max_position_embeddings)
    max_model_len: int               # the sampler's context: prompt + max_tokens


# The context of a model whose config.json names none, with --max-model-len 0 (as vLLM's fallback).
UNNAMED_CONTEXT = 2048


@functools.lru_cache(maxsize=8)
def model_limits(base_model_dir: str, max_model_len: int) -> ModelLimits:
    """From the base model's config.json (read once); `max_model_len` 0: the model's own context."""
    try:
        with open(os.path.join(base_model_dir, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return ModelLimits(None, None, max_model_len or UNNAMED_CONTEXT)
    config = config.get("text_config", config)
    positions = config.get("max_position_embeddings")
    return ModelLimits(config.get("vocab_size"), positions, max_model_len or positions or UNNAMED_CONTEXT)


def _check_tokens(tokens: list[int], where: str, vocab_size: int | None) -> None:
    if vocab_size is not None and tokens and not 0 <= min(tokens) <= max(tokens) < vocab_size:
        bad = next(t for t in tokens if not 0 <= t < vocab_size)
        raise UserError(f"{where}: token id {bad} is outside the vocabulary [0, {vocab_size})")


def check_forward_backward(fb: "ForwardBackward", limits: ModelLimits) -> None:
    """Token ids against the vocabulary, lengths against the trainer's context."""
    for i, d in enumerate(fb.data):
        if limits.max_positions is not None and len(d.tokens) > limits.max_positions:
            raise UserError(f"datum {i}: {len(d.tokens)} tokens exceed the model's context of {limits.max_positions}")
        _check_tokens(d.tokens, f"datum {i}: model_input", limits.vocab_size)
        targets = d.inputs.get("target_tokens")
        if isinstance(targets, Sparse):     # the values sent; the others are 0, a token of every vocabulary
            targets = targets.values
        if targets is not None and targets.dtype.kind in "iu":
            _check_tokens(targets.reshape(-1).tolist(), f"datum {i}: target_tokens", limits.vocab_size)


def check_sample(body: protocol.SampleRequest, limits: ModelLimits) -> None:
    """Prompt and stop token ids against the vocabulary; prompt + max_tokens against the context
    (the length first: an over-long prompt is refused before its tokens are gathered)."""
    max_tokens = body.sampling_params.max_tokens or DEFAULT_MAX_TOKENS
    length = sum(len(c.tokens) for c in body.prompt.chunks if c.type == "encoded_text")
    if length > limits.max_model_len:
        _over_context(length, max_tokens, limits)
    tokens = prompt_tokens(body.prompt)
    _check_tokens(tokens, "prompt", limits.vocab_size)
    stop = body.sampling_params.stop
    if isinstance(stop, list) and stop and all(type(t) is int for t in stop):
        _check_tokens(stop, "sampling_params.stop", limits.vocab_size)
    targets = body.target_prompt_logprobs
    if targets is not None and limits.vocab_size is not None and targets.ids.max() >= limits.vocab_size:
        raise UserError(f"target_prompt_logprobs: token id {targets.ids.max()} is outside the vocabulary "
                        f"[0, {limits.vocab_size}) (-1 asks for nothing)")
    if len(tokens) + max_tokens > limits.max_model_len:
        _over_context(len(tokens), max_tokens, limits)


def _over_context(length: int, max_tokens: int, limits: ModelLimits):
    raise UserError(f"prompt ({length} tokens) + sampling_params.max_tokens ({max_tokens}) exceeds the "
                    f"context length {limits.max_model_len}")


# ---- forward_backward: SDK protobuf -> arrays -> trainer request ---------------------------

@dataclasses.dataclass(frozen=True)
class Sparse:
    """A sparse 2-D loss_fn_input as the SDK sent it (CSR), kept so up to the trainer, which makes
    it dense (tinkerd/tensors.py): a few bytes on the wire stay a few bytes in the queued job and
    its stored row."""
    crow_indices: bytes
    col_indices: bytes
    values: np.ndarray
    shape: tuple[int, int]

    ndim = 2

    @property
    def dtype(self) -> np.dtype:
        return self.values.dtype

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def dense(self) -> np.ndarray:
        return tensors.dense(self.crow_indices, self.col_indices, self.values, self.shape)


def dense(array: "np.ndarray | Sparse") -> np.ndarray:
    return array.dense() if isinstance(array, Sparse) else array


@dataclasses.dataclass
class DatumArrays:
    tokens: list[int]
    inputs: dict[str, "np.ndarray | Sparse"]      # loss_fn_inputs: dense, or sparse as sent
    spans: list[Span]                  # loss_fn_input_spans (provenance); empty where none sent


@dataclasses.dataclass
class ForwardBackward:
    """A decoded forward_backward body: the arrays are edited in place (stable_reinforce puts
    the sampler's logprobs in) before trainer_request() encodes them once."""
    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float]
    forward_only: bool
    data: list[DatumArrays]
    loss_id: str | None = None         # loss_fn "custom": loss_fn_config's text "loss_id" (gateway/custom_losses.py)


@dataclasses.dataclass(frozen=True)
class Budget:
    """What one forward_backward may cost, checked on the parsed body before any array is made:
    a sparse tensor of a few bytes can stand for gigabytes once dense."""
    max_dense_bytes: int = MAX_BODY_BYTES         # loss_fn_inputs made dense on the trainer, all datums and keys
    max_batch_tokens: int = MAX_BATCH_TOKENS      # datums x longest datum: the trainer pads to the longest

    @classmethod
    def of(cls, settings) -> "Budget":
        return cls(settings.max_body_bytes, settings.max_batch_tokens)


def forward_backward(body: bytes, budget: Budget = Budget()) -> ForwardBackward:
    """The SDK's protobuf body, decoded and checked: anything malformed is a UserError."""
    msg = parse_forward_backward(body)
    check_cost(msg, budget)
    return decode_forward_backward(msg)


def parse_forward_backward(body: bytes) -> tw.ForwardBackwardRequest:
    """The body parsed, nothing expanded (its size is the body's): enough to check ownership of
    msg.model_id before check_cost() and decode_forward_backward()."""
    msg = tw.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # noqa: BLE001 - protobuf raises DecodeError and friends
        raise UserError(f"the forward_backward body is not a valid ForwardBackwardRequest: {e}") from None
    if msg.seq_id < 0:
        raise UserError(f"seq_id must be >= 0, got {msg.seq_id}")
    if len(msg.data) > MAX_DATUMS:
        raise UserError(f"{len(msg.data)} datums in one request; at most {MAX_DATUMS}")
    return msg


def check_cost(msg: tw.ForwardBackwardRequest, budget: Budget) -> None:
    """From shapes alone: every loss_fn_input has one row per input token (as the trainer
    requires), their bytes once dense on the trainer stay within budget.max_dense_bytes (a sparse
    int64 tensor of ~200 bytes on the wire can declare 64 MiB), and the padded batch
    within budget.max_batch_tokens. A custom loss may also take one value per datum (its rank-0
    inputs, shape [] or [1]; gateway/custom_losses.py checks each input's rank against the loss)."""
    total, longest = 0, 0
    per_datum_values = msg.loss_fn == "custom"
    for i, datum in enumerate(msg.data):
        n = _token_count(datum, i)
        longest = max(longest, n)
        for key, t in datum.loss_fn_inputs.items():
            where = f"datum {i}: loss_fn_inputs[{key!r}]"
            shape = list(t.shape)
            if any(d < 0 for d in shape):
                raise UserError(f"{where}: negative dimension in shape {shape}")
            if not t.HasField("sparse_csr"):
                shape = shape or [len(t.dense) // _itemsize(t, where)]     # no shape: 1-D
            itemsize = 4 if t.dtype == tw.DTYPE_BFLOAT16 else np.dtype(_numpy_dtype(t, where)).itemsize
            if per_datum_values and len(shape) <= 1 and math.prod(shape) == 1:
                total += itemsize
                continue
            if not shape or shape[0] != n:
                raise UserError(f"{where} has shape {shape}, expected leading dimension {n} (the number of "
                                f"input tokens)")
            total += math.prod(shape) * itemsize
            if total > budget.max_dense_bytes:
                raise UserError(f"loss_fn_inputs hold more than {budget.max_dense_bytes} bytes in all once dense "
                                f"(over every datum and key, as the trainer holds them; the limit is "
                                f"--max-body-bytes): send fewer datums per request, or smaller inputs")
    if len(msg.data) * longest > budget.max_batch_tokens:
        raise UserError(f"{len(msg.data)} datums padded to the longest ({longest} tokens) make "
                        f"{len(msg.data) * longest} tokens, over this server's --max-batch-tokens "
                        f"{budget.max_batch_tokens}: send fewer datums per request, or group them by length")


def _token_count(datum: tw.Datum, i: int) -> int:
    n = 0
    for chunk in datum.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise UserError(f"datum {i}: {kind} inputs are not supported by this server (text only)")
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise UserError(f"datum {i}: model_input tokens are {len(raw)} bytes, not a whole number of int32")
        lowest = np.frombuffer(raw, dtype="<i4").min() if raw else 0
        if lowest < 0:
            raise UserError(f"datum {i}: token id {lowest} is negative")
        n += len(raw) // 4
    return n


def _itemsize(t: tw.Tensor, where: str) -> int:
    """Bytes per value of a dense tensor, whose bytes must be a whole number of them."""
    size = 2 if t.dtype == tw.DTYPE_BFLOAT16 else np.dtype(_numpy_dtype(t, where)).itemsize
    if len(t.dense) % size:
        raise UserError(f"{where}: {len(t.dense)} bytes are not a whole number of {size}-byte values")
    return size


def decode_forward_backward(msg: tw.ForwardBackwardRequest) -> ForwardBackward:
    """The arrays of a parsed body that passed check_cost()."""
    config = dict(msg.loss_fn_config)
    for key, value in msg.loss_fn_config_v2.items():
        if value.WhichOneof("value") == "number":
            config[key] = value.number
    bad = [k for k, v in config.items() if not math.isfinite(v)]
    if bad:
        raise UserError(f"loss_fn_config[{bad[0]!r}] is {config[bad[0]]}; numbers must be finite")
    loss_id = msg.loss_fn_config_v2["loss_id"].text if "loss_id" in msg.loss_fn_config_v2 else None
    return ForwardBackward(msg.model_id, msg.seq_id, msg.loss_fn, config, msg.forward_only,
                           [_datum(d, i) for i, d in enumerate(msg.data)], loss_id)


def _datum(datum: tw.Datum, i: int) -> DatumArrays:
    tokens: list[int] = []      # text only, whole non-negative int32s: check_cost saw to it
    for chunk in datum.model_input:
        tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype="<i4").tolist())
    inputs = {key: _tensor(t, f"datum {i}: loss_fn_inputs[{key!r}]") for key, t in datum.loss_fn_inputs.items()}
    for key, array in inputs.items():      # one NaN makes every gradient, then every weight, NaN
        values = array.values if isinstance(array, Sparse) else array
        if values.dtype.kind == "f" and not np.isfinite(values).all():
            raise UserError(f"datum {i}: loss_fn_inputs[{key!r}] holds NaN or infinite values")
    return DatumArrays(tokens, inputs, [_span(p) for p in datum.loss_fn_input_spans])


def _frombuffer(raw: bytes, dtype: str, where: str) -> np.ndarray:
    size = np.dtype(dtype).itemsize
    if len(raw) % size:
        raise UserError(f"{where}: {len(raw)} bytes are not a whole number of {size}-byte values")
    return np.frombuffer(raw, dtype=dtype)


def _values(t: tw.Tensor, where: str) -> np.ndarray:
    raw = t.dense if t.HasField("dense") else t.sparse_csr.values
    if t.dtype == tw.DTYPE_BFLOAT16:      # numpy has no bfloat16: widen to float32
        return (_frombuffer(raw, "<u2", where).astype(np.uint32) << 16).view(np.float32)
    return _frombuffer(raw, _numpy_dtype(t, where), where)


def _numpy_dtype(t: tw.Tensor, where: str):
    """The numpy dtype of a wire tensor's values (not bfloat16: numpy has none)."""
    try:
        numpy_dtype = dtypes.by_wire_name(tw.DType.Name(t.dtype)).numpy
    except ValueError:                    # unknown to the table or to the SDK's enum
        numpy_dtype = None
    if numpy_dtype is None:
        raise UserError(f"{where}: unsupported dtype {t.dtype}")
    return numpy_dtype


def _tensor(t: tw.Tensor, where: str) -> "np.ndarray | Sparse":
    values, shape = _values(t, where), tuple(t.shape)
    if any(n < 0 for n in shape):
        raise UserError(f"{where}: negative dimension in shape {list(shape)}")
    if t.HasField("sparse_csr"):
        try:
            tensors.csr_indices(t.sparse_csr.crow_indices, t.sparse_csr.col_indices, len(values), shape)
        except ValueError as e:
            raise UserError(f"{where}: {e}") from None
        return Sparse(t.sparse_csr.crow_indices, t.sparse_csr.col_indices, values, shape)
    if not shape:
        shape = (values.size,)
    if math.prod(shape) != values.size:     # Python ints: no overflow on huge shapes
        raise UserError(f"{where}: {values.size} values do not fill shape {list(shape)}")
    return values.reshape(shape)


def _span(p: tw.ProvenanceSpan) -> Span:
    kind = p.WhichOneof("span")
    arm = p.sampled_tokens if kind == "sampled_tokens" else p.prompt_tokens
    if arm.length < 0 or arm.offset < 0:
        raise UserError(f"provenance span with negative offset or length: {arm}")
    return Span(sampled=kind == "sampled_tokens", sequence_id=arm.sequence_id, offset=arm.offset, length=arm.length)


def trainer_request(fb: ForwardBackward) -> trainer_pb2.ForwardBackwardRequest:
    out = trainer_pb2.ForwardBackwardRequest(model_id=fb.model_id, seq_id=fb.seq_id, loss_fn=fb.loss_fn,
                                             loss_fn_config=fb.loss_fn_config, forward_only=fb.forward_only)
    for datum in fb.data:
        d = out.data.add(tokens=datum.tokens)
        for key, array in datum.inputs.items():
            d.loss_fn_inputs[key].CopyFrom(_wire_tensor(array))
    return out


def _wire_tensor(array: "np.ndarray | Sparse") -> common_pb2.Tensor:
    if not isinstance(array, Sparse):
        return from_numpy(array)
    out = from_numpy(array.values)
    del out.shape[:]
    out.shape.extend(array.shape)
    out.sparse_csr.crow_indices, out.sparse_csr.col_indices = array.crow_indices, array.col_indices
    return out


def forward_backward_output(reply: trainer_pb2.ForwardBackwardResponse) -> bytes:
    out = tw.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=dict(reply.metrics))
    record = out.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(reply.outputs))
    keys = sorted(reply.outputs[0].outputs) if reply.outputs else []
    for key in keys:
        record.fields[key].CopyFrom(_batched([o.outputs[key] for o in reply.outputs]))
    return out.SerializeToString()


def _batched(tensors: list[common_pb2.Tensor]) -> tw.BatchedTensor:
    """The datums' tensors of one output, as the SDK reads them: one float32 buffer and each
    datum's offset in it. Dense float32 tensors (what the trainer sends) go as their bytes are."""
    if all(t.dtype == common_pb2.DTYPE_FLOAT32 and not t.HasField("sparse_csr")
           and len(t.data) == 4 * math.prod(t.shape or [len(t.data) // 4]) for t in tensors):
        chunks, trailing = [t.data for t in tensors], list(tensors[0].shape[1:])
    else:
        arrays = [to_numpy(t).astype("<f4") for t in tensors]
        chunks, trailing = [a.tobytes() for a in arrays], list(arrays[0].shape[1:])
    offsets = np.cumsum([0] + [len(c) for c in chunks], dtype="<i8")
    return tw.BatchedTensor(data=b"".join(chunks), offsets=offsets.tobytes(), dtype=tw.DTYPE_FLOAT32,
                            trailing_shape=trailing)


# ---- training JSON bodies -> trainer requests ----------------------------------------------

def lora_config(lora: protocol.LoraConfig) -> common_pb2.LoraConfig:
    return common_pb2.LoraConfig(rank=lora.rank, seed=lora.seed, train_attn=lora.train_attn,
                                 train_mlp=lora.train_mlp, train_unembed=lora.train_unembed)


def adam_params(p: protocol.AdamParams) -> common_pb2.AdamParams:
    if p.type not in ("adam", "adamw"):
        raise UserError(f"optimizer {p.type!r} is not supported; use AdamParams or DimuonParams")
    return common_pb2.AdamParams(learning_rate=p.learning_rate, beta1=p.beta1, beta2=p.beta2, eps=p.eps,
                                 weight_decay=p.weight_decay, grad_clip_norm=p.grad_clip_norm)


def dimuon_params(p: protocol.DimuonParams) -> common_pb2.DimuonParams:
    """A nonpositive grad_clip_norm disables clipping (the SDK's doc): 0 on the wire."""
    return common_pb2.DimuonParams(learning_rate=p.learning_rate, beta1=p.beta1, damping=p.damping,
                                   rank_lr_correction_exponent=p.rank_lr_correction_exponent,
                                   grad_clip_norm=max(p.grad_clip_norm, 0.0))


def params_optimizer(p: protocol.AdamParams | protocol.DimuonParams) -> str:
    """The optimizer an optim_step's parameters are for."""
    return DIMUON if isinstance(p, protocol.DimuonParams) else ADAMW


def optim_step_request(model_id: str, seq_id: int, p: protocol.AdamParams | protocol.DimuonParams,
                       optimizer: str) -> trainer_pb2.OptimStepRequest:
    """The trainer's request for a model of `optimizer`; the other family's parameters are refused
    (a model's optimizer is fixed when it is created)."""
    given = params_optimizer(p)
    if given != optimizer:
        raise UserError(f"model {model_id} was created with the {optimizer} optimizer; optim_step got "
                        f"{PARAMS_CLASS[given]}: send {PARAMS_CLASS[optimizer]}")
    if given == DIMUON:
        return trainer_pb2.OptimStepRequest(model_id=model_id, seq_id=seq_id, dimuon_params=dimuon_params(p))
    return trainer_pb2.OptimStepRequest(model_id=model_id, seq_id=seq_id, adam_params=adam_params(p))


OPTIMIZERS = {ADAMW: common_pb2.OPTIMIZER_ADAMW, DIMUON: common_pb2.OPTIMIZER_DIMUON}


# ---- sampling: JSON body -> sampler request; sampler reply -> SDK protobuf -------------------

def sample_request(body: protocol.SampleRequest, snapshot_id: str, snapshot_path: str) -> sampler_pb2.SampleRequest:
    out = sampler_pb2.SampleRequest(
        snapshot_id=snapshot_id, snapshot_path=snapshot_path, prompt_tokens=prompt_tokens(body.prompt),
        num_samples=body.num_samples, params=sampling_params(body.sampling_params),
        prompt_logprobs=body.prompt_logprobs, topk_prompt_logprobs=body.topk_prompt_logprobs,
        prompt_logprobs_last_n=body.prompt_logprobs_last_n or 0, topk_sample_logprobs=body.topk_sample_logprobs)
    if body.target_prompt_logprobs is not None:
        out.prompt_target_ids.CopyFrom(_target_ids(body.target_prompt_logprobs))
    return out


def _target_ids(t: protocol.TargetTokens) -> common_pb2.Tensor:
    """target_prompt_logprobs as it came, dense or CSR: the sampler answers in its layout."""
    out = common_pb2.Tensor(dtype=common_pb2.DTYPE_INT64, shape=t.shape, data=t.ids.astype("<i8").tobytes())
    if t.crow is not None:
        out.sparse_csr.crow_indices, out.sparse_csr.col_indices = t.crow.tobytes(), t.col.tobytes()
    return out


def prompt_tokens(prompt: protocol.ModelInput) -> list[int]:
    tokens: list[int] = []
    for chunk in prompt.chunks:
        if chunk.type != "encoded_text":
            raise UserError(f"{chunk.type} prompt chunks are not supported by this server (text only)")
        tokens.extend(chunk.tokens)
    return tokens


def sampling_params(p: protocol.SamplingParams) -> sampler_pb2.SamplingParams:
    out = sampler_pb2.SamplingParams(max_tokens=p.max_tokens or DEFAULT_MAX_TOKENS, temperature=p.temperature,
                                     top_p=p.top_p, top_k=p.top_k, seed=p.seed)
    stop = p.stop
    if stop is None:
        out.stop_mode = _Stop.STOP_MODE_DEFAULT
    elif isinstance(stop, str):
        out.stop_mode, out.stop_strings[:] = _Stop.STOP_MODE_STRINGS, [stop]
    elif len(stop) == 0:
        out.stop_mode = _Stop.STOP_MODE_NONE
    elif all(isinstance(s, str) for s in stop):
        out.stop_mode, out.stop_strings[:] = _Stop.STOP_MODE_STRINGS, stop
    else:
        out.stop_mode, out.stop_token_ids[:] = _Stop.STOP_MODE_TOKENS, stop
    return out


def _topk(src: sampler_pb2.TopkLogprobs) -> tw.TopkLogprobs:
    return tw.TopkLogprobs(token_ids=np.asarray(src.token_ids, dtype="<i4").tobytes(),
                           logprobs=np.asarray(src.logprobs, dtype="<f4").tobytes(),
                           k=src.k, length=len(src.token_ids) // max(src.k, 1))


def sample_response(reply: sampler_pb2.SampleResponse) -> bytes:
    out = tw.SampleResponse()
    for seq in reply.sequences:
        s = out.sequences.add(stop_reason=(tw.STOP_REASON_LENGTH if seq.stop_reason == sampler_pb2.STOP_REASON_LENGTH
                                           else tw.STOP_REASON_STOP),
                              tokens=np.asarray(seq.tokens, dtype="<i4").tobytes(),
                              logprobs=np.asarray(seq.logprobs, dtype="<f4").tobytes())
        if seq.HasField("topk_logprobs"):
            s.topk_sampled_logprobs.CopyFrom(_topk(seq.topk_logprobs))
    if len(reply.prompt_logprobs):
        out.prompt_logprobs = np.asarray(reply.prompt_logprobs, dtype="<f4").tobytes()
    if reply.HasField("topk_prompt_logprobs"):
        out.topk_prompt_logprobs.CopyFrom(_topk(reply.topk_prompt_logprobs))
    if reply.HasField("prompt_target_logprobs"):
        out.target_prompt_logprobs.CopyFrom(_sdk_tensor(reply.prompt_target_logprobs))
    return out.SerializeToString()


def _sdk_tensor(t: common_pb2.Tensor) -> tw.Tensor:
    """A float32 sampler tensor as the SDK's, dense or CSR as it is."""
    out = tw.Tensor(dtype=tw.DTYPE_FLOAT32, shape=list(t.shape))
    if t.HasField("sparse_csr"):
        out.sparse_csr.CopyFrom(tw.SparseCsr(values=t.data, crow_indices=t.sparse_csr.crow_indices,
                                             col_indices=t.sparse_csr.col_indices))
    else:
        out.dense = t.data
    return out
