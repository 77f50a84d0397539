"""gateway/convert.py: our tinker wire schema (proto/gateway/tinker_wire.proto) agrees with the SDK's own, field by
field, and the gateway's encoders produce what the SDK's decoders read."""

import numpy as np
import pytest

from gateway import tinker_wire_pb2 as ours
from gateway import convert
from tinkerd.v1 import sampler_pb2, trainer_pb2

sdk = pytest.importorskip("tinker.proto.tinker_public_pb2")

MESSAGES = ["ForwardBackwardRequest", "Datum", "Chunk", "EncodedTextChunk", "Tensor", "SparseCsr",
            "ForwardBackwardOutput", "ArrayRecord", "BatchedTensor", "SampleResponse", "SampledSequence",
            "TopkLogprobs", "LossConfigValue", "ProvenanceSpan", "SampledProvenanceSpan"]


@pytest.mark.parametrize("name", MESSAGES)
def test_field_numbers_and_types_match_the_sdk(name):
    a = getattr(ours, name).DESCRIPTOR
    b = getattr(sdk, name).DESCRIPTOR
    ours_fields = {f.name: (f.number, f.type) for f in a.fields}
    sdk_fields = {f.name: (f.number, f.type) for f in b.fields}
    for field, spec in ours_fields.items():
        assert sdk_fields.get(field) == spec, f"{name}.{field}: ours {spec}, SDK {sdk_fields.get(field)}"


def test_forward_backward_output_decodes_in_the_sdk():
    from tinker.proto.response_conv import deserialize_forward_backward_output
    from tinkerd.tensors import from_numpy

    reply = trainer_pb2.ForwardBackwardResponse(metrics={"loss:sum": 3.5})
    for n in (3, 5):      # float32 goes as its bytes are; float16 (and int) is converted
        reply.outputs.add(outputs={"logprobs": from_numpy(-np.arange(n, dtype=np.float32)),
                                   "half": from_numpy(np.arange(n, dtype=np.float16) / 4),
                                   "pairs": from_numpy(np.arange(2 * n, dtype=np.float32).reshape(n, 2))})
    out = deserialize_forward_backward_output(convert.forward_backward_output(reply))
    assert [o["logprobs"].to_numpy().tolist() for o in out.loss_fn_outputs] == [[0, -1, -2], [0, -1, -2, -3, -4]]
    assert [o["half"].to_numpy().tolist() for o in out.loss_fn_outputs] == [[0, .25, .5], [0, .25, .5, .75, 1]]
    assert out.loss_fn_outputs[1]["pairs"].to_numpy().tolist() == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert out.metrics["loss:sum"] == 3.5


def test_sample_response_decodes_in_the_sdk():
    from tinker.proto.response_conv import deserialize_sample_response

    reply = sampler_pb2.SampleResponse(prompt_logprobs=[float("nan"), -1.0, -2.0])
    seq = reply.sequences.add(tokens=[4, 5], logprobs=[-0.5, -0.25], stop_reason=sampler_pb2.STOP_REASON_LENGTH)
    seq.topk_logprobs.CopyFrom(sampler_pb2.TopkLogprobs(k=2, token_ids=[4, 7, 5, 0], logprobs=[-0.5, -1.0, -0.25, -99999.0]))
    out = deserialize_sample_response(convert.sample_response(reply))
    assert out.prompt_logprobs[0] is None and out.prompt_logprobs[1:] == [-1.0, -2.0]
    assert out.sequences[0].tokens == [4, 5] and out.sequences[0].stop_reason == "length"
    assert out.sequences[0].logprobs == [-0.5, -0.25]


def test_sparse_csr_inputs_stay_sparse_up_to_the_trainer():
    """The trainer's request carries a sparse input as it came (its few bytes, not the dense
    array): the trainer makes it dense (tinkerd/tensors.to_numpy)."""
    req = ours.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    d = req.data.add()
    d.model_input.add().encoded_text.tokens = np.array([1, 2], dtype="<i4").tobytes()
    t = d.loss_fn_inputs["weights"]
    t.dtype, t.shape[:] = ours.DTYPE_FLOAT32, [2, 3]
    t.sparse_csr.values = np.array([0.5, 2.0], dtype="<f4").tobytes()
    t.sparse_csr.crow_indices = np.array([0, 1, 2], dtype="<i8").tobytes()
    t.sparse_csr.col_indices = np.array([2, 0], dtype="<i8").tobytes()
    fb = convert.forward_backward(req.SerializeToString())
    assert fb.data[0].inputs["weights"].dense().tolist() == [[0, 0, 0.5], [2.0, 0, 0]]
    assert fb.data[0].tokens == [1, 2]
    from tinkerd.tensors import to_numpy
    msg = convert.trainer_request(fb)
    wire = msg.data[0].loss_fn_inputs["weights"]
    assert wire.HasField("sparse_csr") and len(wire.data) == 8
    assert to_numpy(wire).tolist() == [[0, 0, 0.5], [2.0, 0, 0]]
    assert list(msg.data[0].tokens) == [1, 2]
