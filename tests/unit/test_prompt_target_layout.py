"""target_prompt_logprobs (SDK 0.38's SampleRequest): checked in the gateway's body model, carried
to the sampler in the layout it came in (dense or CSR), made compact for the engine there
(sampler_service/convert.py), and answered in that same layout, which the SDK decodes; and
prompt_logprobs_last_n held to its docstring. The engine's scoring itself:
tests/sampler/test_grouped_lora_engine.py; through the SDK on a real stack:
tests/e2e/test_prompt_targets.py."""

from __future__ import annotations

import math
import types

import numpy as np
import pydantic
import pytest

from gateway import convert, protocol
from sampler_service import convert as sampler_convert
from tinkerd.errors import UserError

PROMPT = [5, 17, 300, 42, 9, 88]           # 5 scored positions


def _body(target: dict | None = None, **fields) -> protocol.SampleRequest:
    body = {"prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
            "sampling_params": {"max_tokens": 1}, **fields}
    if target is not None:
        body["target_prompt_logprobs"] = target
    return protocol.SampleRequest.model_validate(body)


def _dense(ids) -> dict:
    ids = np.asarray(ids)
    return {"data": ids.reshape(-1).tolist(), "dtype": "int64", "shape": list(ids.shape)}


def _sparse(ids) -> dict:
    """As the SDK's TensorData.from_torch_sparse(ids, pad_value=-1) sends it."""
    ids = np.asarray(ids)
    rows, cols = np.nonzero(ids != -1)
    crow = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=ids.shape[0]))])
    return {"data": ids[rows, cols].tolist(), "dtype": "int64", "shape": list(ids.shape),
            "sparse_crow_indices": crow.tolist(), "sparse_col_indices": cols.tolist()}


IDS = np.array([[-1, -1, -1],
                [-1, -1, -1],
                [42, 7, -1],
                [9, -1, 3],
                [88, 1, 2]])              # rows 0 and 1 ask nothing: the engine scores from row 2


def _engine_scores(targets: sampler_convert.PromptTargets) -> np.ndarray:
    """A stand-in for the engine's logprobs: row r (prompt row start + r), id t -> -(t + 1000 (start + r)),
    -inf where nothing is asked (as vLLM pads)."""
    rows = targets.start + np.arange(targets.ids.shape[0])[:, None]
    return np.where(targets.ids >= 0, -(targets.ids + 1000.0 * rows), -np.inf).astype(np.float32)


def _output(**fields):
    """A vLLM RequestOutput of one sampled token, with `fields`."""
    return types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[4], logprobs=None, finish_reason="length")],
                                 **fields)


def _expected(ids: np.ndarray) -> np.ndarray:
    rows = np.arange(ids.shape[0])[:, None]
    return np.where(ids >= 0, -(ids + 1000.0 * rows), 0.0).astype(np.float32)


@pytest.mark.parametrize("layout", [_dense, _sparse])
def test_targets_go_to_the_sampler_and_come_back_in_the_callers_layout(layout):
    from tinker.proto.response_conv import deserialize_sample_response

    body = _body(layout(IDS))
    convert.check_sample(body, convert.ModelLimits(1024, 1024, 1024))
    msg = convert.sample_request(body, "", "")
    assert msg.prompt_target_ids.HasField("sparse_csr") == (layout is _sparse)

    targets = sampler_convert.prompt_targets(msg, vocab_size=1024)
    assert targets.start == 2 and targets.ids.tolist() == [[42, 7, -1], [9, 3, -1], [88, 1, 2]]
    assert targets.engine_arg()["start"] == 2 and targets.engine_arg()["width"] == 3

    output = _output(prompt_logprobs=None, prompt_token_id_logprobs=_engine_scores(targets))
    reply = sampler_convert.sample_response(msg, [output], targets)
    got = deserialize_sample_response(convert.sample_response(reply)).target_prompt_logprobs
    assert got.dtype == "float32" and got.shape == [5, 3]
    if layout is _sparse:
        assert got.sparse_crow_indices == layout(IDS)["sparse_crow_indices"]
        assert got.sparse_col_indices == layout(IDS)["sparse_col_indices"]
    np.testing.assert_array_equal(got.to_numpy(), _expected(IDS))


def test_a_listed_cell_of_minus_one_asks_nothing_and_gets_zero():
    ids = np.full((5, 2), -1)
    ids[4] = [3, -1]
    target = _sparse(ids)
    target["data"], target["sparse_crow_indices"], target["sparse_col_indices"] = [3, -1], [0, 0, 0, 0, 0, 2], [0, 1]
    msg = convert.sample_request(_body(target), "", "")
    targets = sampler_convert.prompt_targets(msg, vocab_size=1024)
    values = np.frombuffer(targets.reply(_engine_scores(targets)).data, dtype="<f4")
    assert values.tolist() == [-4003.0, 0.0]


@pytest.mark.parametrize("target, words", [
    ({"data": [1] * 5, "dtype": "float32", "shape": [5, 1]}, ["target_prompt_logprobs.dtype", "int64"]),
    ({"data": [1] * 5, "dtype": "int64", "shape": [5]}, ["target_prompt_logprobs.shape"]),
    ({"data": [1] * 4, "dtype": "int64", "shape": [4, 1]}, ["target_prompt_logprobs", "[5, K]"]),
    ({"data": [1] * 6, "dtype": "int64", "shape": [6, 1]}, ["target_prompt_logprobs", "[5, K]"]),
    ({"data": [1] * 4, "dtype": "int64", "shape": [5, 1]}, ["target_prompt_logprobs", "do not fill shape"]),
    (_dense(np.full((5, 2), -1)), ["target_prompt_logprobs", "names no token id"]),
    (_dense(np.full((5, 1), -2)), ["target_prompt_logprobs.data.0", "greater than or equal to -1"]),
    (_dense(np.arange(5 * 21).reshape(5, 21)), ["target_prompt_logprobs", "21 token ids", "at most 20"]),
    ({**_sparse(IDS), "sparse_col_indices": [0, 1, 0, 2, 0, 1, 7]}, ["target_prompt_logprobs", "malformed"]),
    ({**_sparse(IDS), "sparse_col_indices": None}, ["target_prompt_logprobs", "come together"]),
])
def test_bad_targets_are_refused_by_name(target, words):
    with pytest.raises(pydantic.ValidationError) as e:
        _body(target)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_a_target_id_outside_the_vocabulary_is_refused_by_the_gateway_and_the_sampler():
    body = _body(_dense(np.full((5, 1), 1024)))
    with pytest.raises(UserError, match=r"target_prompt_logprobs: token id 1024 is outside the vocabulary \[0, 1024\)"):
        convert.check_sample(body, convert.ModelLimits(1024, 1024, 1024))
    msg = convert.sample_request(body, "", "")
    with pytest.raises(UserError, match="target_prompt_logprobs: token id 1024 is outside the vocabulary"):
        sampler_convert.prompt_targets(msg, vocab_size=1024)


def test_the_sampler_checks_the_shape_against_the_prompt():
    msg = convert.sample_request(_body(_dense(IDS)), "", "")
    del msg.prompt_tokens[-1]
    with pytest.raises(UserError, match=r"target_prompt_logprobs has shape \[5, 3\]; a prompt of 5 tokens takes"):
        sampler_convert.prompt_targets(msg, vocab_size=1024)


def test_prompt_logprobs_last_n_as_its_docstring_says():
    """Requires prompt_logprobs, is 1 .. len(prompt) - 1, and blanks earlier positions of both
    prompt_logprobs and topk_prompt_logprobs (the SDK decodes an all-sentinel row as None)."""
    for fields, words in [({"prompt_logprobs_last_n": 2}, ["set prompt_logprobs"]),
                          ({"prompt_logprobs": True, "prompt_logprobs_last_n": 6}, ["prompt_logprobs_last_n is 6",
                                                                                    "5 positions"]),
                          ({"prompt_logprobs": True, "prompt_logprobs_last_n": 0}, ["prompt_logprobs_last_n"])]:
        with pytest.raises(pydantic.ValidationError) as e:
            _body(**fields)
        assert all(w in str(e.value) for w in words), str(e.value)
    assert convert.sample_request(_body(prompt_logprobs=True), "", "").prompt_logprobs_last_n == 0

    from tinker.proto.response_conv import deserialize_sample_response

    msg = convert.sample_request(_body(prompt_logprobs=True, topk_prompt_logprobs=1, prompt_logprobs_last_n=2), "", "")
    rows = [None] + [{t: types.SimpleNamespace(logprob=-float(t), rank=1)} for t in PROMPT[1:]]   # vLLM's Logprob
    output = _output(prompt_logprobs=rows)
    out = deserialize_sample_response(convert.sample_response(sampler_convert.sample_response(msg, [output])))
    assert out.prompt_logprobs == [None, None, None, None, -9.0, -88.0]
    assert out.topk_prompt_logprobs == [None, None, None, None, [(9, -9.0)], [(88, -88.0)]]


def test_an_unscored_target_is_an_internal_error_not_a_made_up_value():
    msg = convert.sample_request(_body(_dense(IDS)), "", "")
    targets = sampler_convert.prompt_targets(msg, vocab_size=1024)
    scores = _engine_scores(targets)
    scores[0, 0] = math.nan
    with pytest.raises(Exception, match="unscored"):
        targets.reply(scores)
