"""The edge's pure checks (issue 12): bounded zstd, the base model's limits, checkpoint names,
Adam parameters in the trainer, bodies parsed by hand."""

import json
import math
import tracemalloc

import numpy as np
import pytest
import zstandard

from gateway import checkpoints, convert, protocol
from tinkerd.errors import UserError


def test_a_zstd_bomb_is_refused_without_inflating_past_the_limit():
    bomb = zstandard.ZstdCompressor(level=19).compress(b"\0" * (256 << 20))
    tracemalloc.start()
    try:
        with pytest.raises(convert.BodyTooLarge, match="inflates"):
            convert.decompress(bomb, "zstd", max_bytes=4 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak
    assert convert.decompress(zstandard.ZstdCompressor().compress(b"abc"), "zstd", max_bytes=3) == b"abc"
    with pytest.raises(UserError, match="zstd"):
        convert.decompress(b"\x28\xb5\x2f\xfdnot zstd", "zstd")


def test_model_limits_come_from_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 100,
                                                                      "max_position_embeddings": 64}}))
    assert convert.model_limits(str(tmp_path), 50) == convert.ModelLimits(100, 64, 50)
    assert convert.model_limits(str(tmp_path / "missing"), 50) == convert.ModelLimits(None, None, 50)


def _sample(tokens, **params):
    return protocol.SampleRequest.model_validate({"prompt": {"chunks": [{"tokens": tokens}]},
                                                  "sampling_params": params})


def test_check_sample_holds_tokens_to_the_vocabulary_and_the_context():
    limits = convert.ModelLimits(vocab_size=100, max_positions=64, max_model_len=50)
    convert.check_sample(_sample([1, 2], max_tokens=48, stop=[99]), limits)
    with pytest.raises(UserError, match="prompt: token id 100 is outside the vocabulary"):
        convert.check_sample(_sample([1, 100]), limits)
    with pytest.raises(UserError, match="sampling_params.stop: token id 100"):
        convert.check_sample(_sample([1], stop=[100]), limits)
    with pytest.raises(UserError, match="exceeds the context length 50"):
        convert.check_sample(_sample([1, 2], max_tokens=49), limits)
    convert.check_sample(_sample([1, 2]), convert.ModelLimits(None, None, 1024))   # unknown vocabulary


def test_the_context_is_the_models_own_unless_a_length_is_given(tmp_path):
    (tmp_path / "config.json").write_text('{"vocab_size": 100, "max_position_embeddings": 8192}')
    assert convert.model_limits(str(tmp_path), 0) == convert.ModelLimits(100, 8192, 8192)
    assert convert.model_limits(str(tmp_path), 1024) == convert.ModelLimits(100, 8192, 1024)
    (tmp_path / "unnamed").mkdir()
    (tmp_path / "unnamed" / "config.json").write_text('{"vocab_size": 100}')
    assert convert.model_limits(str(tmp_path / "unnamed"), 0).max_model_len == convert.UNNAMED_CONTEXT


def _fb(tokens, targets):
    datum = convert.DatumArrays(tokens, {"target_tokens": np.asarray(targets, np.int64)}, [])
    return convert.ForwardBackward("m", 1, "cross_entropy", {}, False, [datum])


def test_check_forward_backward_holds_tokens_to_the_vocabulary_and_the_context():
    limits = convert.ModelLimits(vocab_size=100, max_positions=4, max_model_len=50)
    convert.check_forward_backward(_fb([1, 2, 3], [2, 3, 0]), limits)
    with pytest.raises(UserError, match="datum 0: model_input: token id 100"):
        convert.check_forward_backward(_fb([1, 100], [2, 3]), limits)
    with pytest.raises(UserError, match="datum 0: target_tokens: token id 1000"):
        convert.check_forward_backward(_fb([1, 2], [2, 1000]), limits)
    with pytest.raises(UserError, match="exceed the model's context of 4"):
        convert.check_forward_backward(_fb([1] * 5, [1] * 5), limits)


@pytest.mark.parametrize("name", ["..", ".", ".x", "a/b", "a\x00b", "a\n", "", "x" * 256, None, 5])
def test_checkpoint_names_that_could_leave_their_directory_are_refused(name):
    with pytest.raises(UserError, match="path"):
        checkpoints.checkpoint_name(name)


@pytest.mark.parametrize("name", ["step-1", "final", "a.b", "x" * 255, "0"])
def test_ordinary_checkpoint_names_pass(name):
    assert checkpoints.checkpoint_name(name) == name


@pytest.mark.parametrize("field, value", [("learning_rate", math.nan), ("learning_rate", -1.0),
                                          ("beta1", 1.0), ("beta2", math.inf), ("eps", 0.0),
                                          ("weight_decay", -0.1), ("grad_clip_norm", math.nan),
                                          ("learning_rate", 1e4), ("weight_decay", 2.0), ("eps", 10.0)])
def test_the_trainer_refuses_adam_parameters_that_would_ruin_the_weights(field, value):
    from trainer_service.training import AdamParams, check_adam
    params = dict(learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.0, grad_clip_norm=0.0)
    check_adam(AdamParams(**params))
    with pytest.raises(UserError, match="Adam"):
        check_adam(AdamParams(**{**params, field: value}))


@pytest.mark.parametrize("raw, words", [(b"[" * 100_000, "nested too deeply"), (b'{"a": "\xff"}', "not valid JSON"),
                                        (b"9" * 5000, "not valid JSON"), (b"{", "not valid JSON")])
def test_parse_json_makes_every_bad_body_a_user_error(raw, words):
    with pytest.raises(UserError, match=words):
        protocol.parse_json(raw)
