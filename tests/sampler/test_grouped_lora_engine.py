"""A vLLM engine configured as our sampler configures it (max_lora_rank 64, max_loras 4, our
worker extension) gives the same logprobs with our CPU LoRA path as with vLLM's own: prompt
and sampled logprobs, adapters of ranks 8, 16 and 64 in one batch, and base-model requests in a
mixed batch equal to the base model alone."""

from __future__ import annotations

import os

import numpy as np
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


def test_prompt_target_ids_get_the_prompt_logprobs_of_those_ids_in_a_mixed_batch(engine):
    """target_prompt_logprobs (worker_ext._score_prompt_targets): in one batch of adapters and the
    base model, each request's target ids get exactly the logprobs vLLM's prompt logprobs give
    those ids in the same prefill (the prompt token itself and four of its top 20 at every
    position), from the first row that names one (a row before it asks nothing)."""
    from vllm import SamplingParams

    from sampler_service import convert
    from tinkerd.tensors import from_numpy
    from tinkerd.v1 import sampler_pb2

    llm, req = engine
    loras = [req[8], None, req[64], req[16]]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    top = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=4),
                       lora_request=loras, use_tqdm=False)
    messages, targets = [], []
    for i, (prompt, out) in enumerate(zip(PROMPTS, top)):
        ids = np.array([[t] + [tid for tid, lp in sorted(row.items(), key=lambda kv: kv[1].rank)
                               if lp.rank <= 4][:4] for t, row in zip(prompt[1:], out.prompt_logprobs[1:])])
        if i == 1:
            ids[:2] = -1                   # scored from row 2
        msg = sampler_pb2.SampleRequest(prompt_tokens=prompt, prompt_logprobs=True, topk_prompt_logprobs=20,
                                        params=sampler_pb2.SamplingParams(max_tokens=1, top_p=1.0))
        msg.prompt_target_ids.CopyFrom(from_numpy(ids.astype(np.int64)))
        messages.append(msg)
        targets.append(convert.prompt_targets(msg, vocab_size=1024))
    assert targets[1].start == 2 and targets[0].start == 0
    params = [convert.sampling_params(m, t) for m, t in zip(messages, targets)]
    assert all(p.skip_reading_prefix_cache and convert.PROMPT_TARGETS_ARG in p.extra_args for p in params)
    outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    for msg, t, out in zip(messages, targets, outs):
        ids = np.frombuffer(msg.prompt_target_ids.data, dtype="<i8").reshape(len(msg.prompt_tokens) - 1, 5)
        got = np.frombuffer(t.reply(out.prompt_token_id_logprobs).data, dtype="<f4").reshape(ids.shape)
        want = np.array([[row[x].logprob if x >= 0 else 0.0 for x in ids_row]
                         for ids_row, row in zip(ids, out.prompt_logprobs[1:])], dtype=np.float32)
        np.testing.assert_array_equal(got, want)
