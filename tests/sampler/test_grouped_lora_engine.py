"""A vLLM engine configured as our sampler configures it (max_lora_rank 64, max_loras 4, our
worker extension) gives the same logprobs with our CPU LoRA path as with vLLM's own: prompt
and sampled logprobs, adapters of ranks 8, 16 and 64 in one batch, and base-model requests in a
mixed batch equal to the base model alone."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import TINY_KV_CACHE_MIB
from harness.models import build_lora_adapter
from sampler_service.engine import size_cpu_kv_cache

TOL = 1e-4
PROMPTS = [[5, 17, 300, 42, 9, 88, 120, 7], [11, 12, 13, 14, 15, 16], [900, 4, 60, 61, 62, 63, 64, 65, 66],
           [33, 34, 35, 36, 37]]


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    size_cpu_kv_cache(TINY_KV_CACHE_MIB)
    from vllm import LLM
    from vllm.lora.request import LoRARequest

    root = tmp_path_factory.mktemp("adapters")
    requests = {r: LoRARequest(f"r{r}", r, str(build_lora_adapter(tiny_model_dir, root / f"r{r}", rank=r, seed=r)))
                for r in (8, 16, 64)}
    llm = LLM(model=tiny_model_dir, dtype="float32", enforce_eager=True, max_model_len=256, seed=0,
              enable_lora=True, max_lora_rank=64, max_loras=4, max_num_seqs=16,
              kv_cache_memory_bytes=TINY_KV_CACHE_MIB << 20,
              worker_extension_cls="sampler_service.worker_ext.SnapshotWorkerExtension")
    llm.collective_rpc("tinkerd_install_lora_fixes")
    yield llm, requests
    _grouped(True)            # as the extension left it
    # The in-process engine made this process's default torch.distributed group: take it down,
    # or DeepSpeed in later tests of this process finds a group it did not set up.
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel
    del llm
    destroy_model_parallel()
    destroy_distributed_environment()


def _grouped(on: bool) -> None:
    """Our CPU LoRA path (grouped ops, each LoRA linear layer whole) or vLLM's own."""
    from sampler_service import worker_ext
    (worker_ext.patch_cpu_punica_ops if on else worker_ext.unpatch_cpu_punica_ops)()


def _generate(llm, prompts, loras) -> list[tuple[list[int], torch.Tensor]]:
    """Per request: its greedy tokens, and the logprobs of its prompt and sampled tokens."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras, use_tqdm=False)
    result = []
    for prompt, out in zip(prompts, outs):
        seq = out.outputs[0]
        prompt_lp = [d[t].logprob for t, d in zip(prompt[1:], out.prompt_logprobs[1:])]
        sampled_lp = [d[t].logprob for t, d in zip(seq.token_ids, seq.logprobs)]
        result.append((list(seq.token_ids), torch.tensor(prompt_lp + sampled_lp)))
    return result


def _assert_same(got, want):
    for (tokens, lp), (want_tokens, want_lp) in zip(got, want):
        assert tokens == want_tokens
        torch.testing.assert_close(lp, want_lp, rtol=0, atol=TOL)


def test_adapters_of_several_ranks_in_one_batch_match_vllms_ops(engine):
    llm, req = engine
    loras = [req[8], req[16], req[64], req[8]]
    _grouped(False)
    want = _generate(llm, PROMPTS, loras)
    _grouped(True)
    got = _generate(llm, PROMPTS, loras)
    _assert_same(got, want)
    base = _generate(llm, PROMPTS[:1], None)[0][1]
    assert (base - got[0][1]).abs().max() > 1e-2      # the adapter does change the logprobs


def test_mixed_batch_rows_match_each_request_alone(engine):
    llm, req = engine
    loras = [None, req[16], None, req[64]]
    _grouped(False)           # alone, no row of another slot: vLLM's ops are the reference
    want = [_generate(llm, [p], lora)[0] for p, lora in zip(PROMPTS, loras)]
    _grouped(True)
    _assert_same(_generate(llm, PROMPTS, loras), want)
