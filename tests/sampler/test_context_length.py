"""--max-model-len 0, the default: a replica serves the model's own context (config.json), cut to
what its KV cache holds, and says so; it used to be 1024 tokens whatever the model, so a
2,000-token prompt to SmolLM2 (8,192) was refused unless the operator knew the flag."""

from __future__ import annotations

import logging

import pytest

from harness.models import build_tiny_model
from tinkerd.errors import UserError

pytestmark = pytest.mark.slow       # a vLLM engine


def test_the_default_context_is_the_models_cut_to_what_the_kv_cache_holds(tmp_path, caplog):
    from sampler_service.engine import SamplerEngine
    from vllm import SamplingParams
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    model = build_tiny_model(tmp_path / "long", context=65536)          # 512 bytes of KV cache a token
    with caplog.at_level(logging.INFO, logger="sampler_service.engine"):
        engine = SamplerEngine(str(model), dtype="float32", max_num_seqs=4, kv_cache_mib=1)
    try:
        held = engine.max_model_len
        assert 1024 <= held < 65536, held             # 1 MiB holds ~2,000 tokens
        assert held == engine._engine.model_config.max_model_len == engine._engine_args["max_model_len"]
        assert f"context length: {held} tokens" in caplog.text
        greedy = dict(temperature=0.0, ignore_eos=True)
        prompt = list(range(1, 1001))                 # within the cut context, beyond the old 1024 in all
        out = engine.generate(prompt, SamplingParams(max_tokens=100, **greedy), 1).result(120)[0]
        assert len(out.outputs[0].token_ids) == 100
        with pytest.raises(UserError, match=f"exceeds the context length {held}"):
            engine.generate([1, 2, 3], SamplingParams(max_tokens=held, **greedy), 1)
    finally:
        engine.shutdown()
        destroy_model_parallel()
        destroy_distributed_environment()
