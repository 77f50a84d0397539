"""The tinker SDK's binary bodies (application/x-protobuf, maybe zstd) <-> our gRPC messages.

The only module that knows both schemas. Everything the SDK can send but we cannot serve
(images, audio) is rejected here with a user error.
"""

from __future__ import annotations

import numpy as np

from gateway import tinker_wire_pb2 as tw
from gateway.stability import Span
from tinkerd.errors import UserError
from tinkerd.v1 import common_pb2, sampler_pb2, trainer_pb2

_NP = {tw.DTYPE_FLOAT32: np.dtype("<f4"), tw.DTYPE_INT64: np.dtype("<i8"), tw.DTYPE_INT32: np.dtype("<i4")}


def decompress(body: bytes, content_encoding: str | None) -> bytes:
    if content_encoding and "zstd" in content_encoding.lower():
        import zstandard
        return zstandard.ZstdDecompressor().decompressobj().decompress(body)
    return body


def _tensor_to_numpy(t: tw.Tensor, where: str) -> np.ndarray:
    if t.dtype == tw.DTYPE_BFLOAT16:
        raw = np.frombuffer(t.dense if t.HasField("dense") else t.sparse_csr.values, dtype="<u2")
        values = (raw.astype(np.uint32) << 16).view(np.float32)
    elif t.dtype in _NP:
        values = np.frombuffer(t.dense if t.HasField("dense") else t.sparse_csr.values, dtype=_NP[t.dtype])
    else:
        raise UserError(f"{where}: unsupported dtype {tw.DType.Name(t.dtype)}")
    shape = tuple(t.shape)
    if t.HasField("sparse_csr"):
        if len(shape) != 2:
            raise UserError(f"{where}: a sparse tensor needs a 2-D shape, got {list(shape)}")
        crow = np.frombuffer(t.sparse_csr.crow_indices, dtype="<i8")
        col = np.frombuffer(t.sparse_csr.col_indices, dtype="<i8")
        if len(crow) != shape[0] + 1 or len(col) != len(values) or (len(col) and col.max() >= shape[1]):
            raise UserError(f"{where}: malformed sparse CSR tensor")
        dense = np.zeros(shape, dtype=values.dtype)
        rows = np.repeat(np.arange(shape[0]), np.diff(crow))
        dense[rows, col] = values
        return dense
    if not shape:
        shape = (values.size,)
    if int(np.prod(shape)) != values.size:
        raise UserError(f"{where}: {values.size} values do not fill shape {list(shape)}")
    return values.reshape(shape)


def _ours(arr: np.ndarray) -> common_pb2.Tensor:
    from tinkerd.tensors import from_numpy
    return from_numpy(arr)


def forward_backward_request(body: bytes) -> tuple[trainer_pb2.ForwardBackwardRequest, list[list[Span]]]:
    """Our request, and each datum's loss_fn_input_spans (provenance; empty where none was sent)."""
    msg = tw.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # noqa: BLE001 - protobuf raises DecodeError and friends
        raise UserError(f"the forward_backward body is not a valid ForwardBackwardRequest: {e}") from None
    config = dict(msg.loss_fn_config)
    for key, value in msg.loss_fn_config_v2.items():
        if value.WhichOneof("value") == "number":
            config[key] = value.number
    out = trainer_pb2.ForwardBackwardRequest(model_id=msg.model_id, seq_id=msg.seq_id, loss_fn=msg.loss_fn,
                                             loss_fn_config=config, forward_only=msg.forward_only)
    spans: list[list[Span]] = []
    for i, datum in enumerate(msg.data):
        spans.append([_span(p) for p in datum.loss_fn_input_spans])
        d = out.data.add()
        for chunk in datum.model_input:
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise UserError(f"datum {i}: {kind} inputs are not supported by this server (text only)")
            d.tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype="<i4").tolist())
        for key, t in datum.loss_fn_inputs.items():
            d.loss_fn_inputs[key].CopyFrom(_ours(_tensor_to_numpy(t, f"datum {i}: loss_fn_inputs[{key!r}]")))
    return out, spans


def _span(p: tw.ProvenanceSpan) -> Span:
    kind = p.WhichOneof("span")
    arm = p.sampled_tokens if kind == "sampled_tokens" else p.prompt_tokens
    if arm.length < 0 or arm.offset < 0:
        raise UserError(f"provenance span with negative offset or length: {arm}")
    return Span(sampled=kind == "sampled_tokens", sequence_id=arm.sequence_id, offset=arm.offset, length=arm.length)


def forward_backward_output(reply: trainer_pb2.ForwardBackwardResponse) -> bytes:
    from tinkerd.tensors import to_numpy

    out = tw.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=dict(reply.metrics))
    record = out.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(reply.outputs))
    keys = sorted(reply.outputs[0].outputs) if reply.outputs else []
    for key in keys:
        arrays = [to_numpy(o.outputs[key]).astype("<f4") for o in reply.outputs]
        sizes = np.array([0] + [a.nbytes for a in arrays], dtype="<i8")
        record.fields[key].CopyFrom(tw.BatchedTensor(
            data=b"".join(a.tobytes() for a in arrays), offsets=np.cumsum(sizes).astype("<i8").tobytes(),
            dtype=tw.DTYPE_FLOAT32, trailing_shape=list(arrays[0].shape[1:])))
    return out.SerializeToString()


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
    return out.SerializeToString()
