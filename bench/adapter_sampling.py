"""Sampling through one rank-8 LoRA adapter: vLLM's CPU LoRA ops vs our grouped ones (issue 14).

All three in this process, on vllm.LLM with the adapter from a PEFT directory (LoRARequest),
greedy, ignore EOS, the same prompts; rounds alternate among them:
  raw      vLLM configured for just this adapter (max_lora_rank=8, max_loras=1), its own ops;
  vllm-64  vLLM as our sampler starts it (max_lora_rank=64, max_loras=4), vLLM's own ops: every
           token gathers a whole rank-64 matrix per LoRA layer (before);
  ours-64  the same engine with sampler_service/grouped_lora.py installed (after).
The op swap is module-global and the engine runs in this process, so vllm-64 and ours-64 are one
engine with the ops swapped between runs. The figure of merit is ours-64 / raw.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from bench.common import Context, Row, new_dir

PROMPT_LEN, MAX_TOKENS, N_SEQS, RANK = 16, 64, 8, 8


def _prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(5, 1000, (PROMPT_LEN,), generator=gen).tolist() for _ in range(n)]


def _engine(model_dir: str, max_lora_rank: int, max_loras: int):
    from vllm import LLM
    return LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=1024, max_num_seqs=64,
               seed=0, enable_lora=True, max_lora_rank=max_lora_rank, max_loras=max_loras)


def _ops(grouped: bool) -> None:
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    from sampler_service import grouped_lora
    (grouped_lora.install if grouped else grouped_lora.uninstall)(lora_ops, punica_cpu)


def _runner(llm, grouped: bool, prompts, max_tokens: int, adapter: str, seen: dict, key: str,
            temperature: float = 0.0):
    """A function that generates all prompts through the adapter and returns tokens/s."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    request = LoRARequest("bench-adapter", 1, adapter)

    def run() -> float:
        _ops(grouped)
        t0 = time.perf_counter()
        outs = llm.generate(inputs, params, lora_request=request, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        seen[key] = [list(o.outputs[0].token_ids) for o in outs]
        return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed
    return run


def measure(model_dir: str, adapter: str, prompts, max_tokens: int, rounds: int) -> tuple[dict, dict]:
    """Median tokens/s of raw, vllm-64 and ours-64 (rounds in turn), and each one's greedy tokens."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    raw, ours = _engine(model_dir, RANK, 1), _engine(model_dir, 64, 4)
    seen: dict = {}
    runs = {"raw": _runner(raw, False, prompts, max_tokens, adapter, seen, "raw"),
            "vllm-64": _runner(ours, False, prompts, max_tokens, adapter, seen, "vllm-64"),
            "ours-64": _runner(ours, True, prompts, max_tokens, adapter, seen, "ours-64")}
    for name in runs:           # warm-up: first requests and the adapter's first load
        _runner(raw if name == "raw" else ours, name == "ours-64", prompts[:2], 4, adapter, {}, name)()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            times[name].append(fn())
    _ops(True)
    return {name: statistics.median(v) for name, v in times.items()}, seen


def _rows(name: str, model_dir: str, ctx: Context) -> list[Row]:
    from harness.models import build_lora_adapter

    adapter = str(build_lora_adapter(model_dir, new_dir(ctx, f"adapter-{name}"), rank=RANK))
    n, max_tokens = (2, 8) if ctx.quick else (N_SEQS, MAX_TOKENS)
    tps, seen = measure(model_dir, adapter, _prompts(n), max_tokens, ctx.iters(3, 1))
    same = "identical" if seen["ours-64"] == seen["vllm-64"] == seen["raw"] else "DIFFER"
    case = f"{name}: rank-{RANK} adapter, {n}x{max_tokens} tokens, max_lora_rank 64 / max_loras 4"
    return [
        Row("adapter_sampling", f"{case}, grouped ops", tps["ours-64"], tps["raw"], "tok/s",
            ratio=tps["ours-64"] / tps["raw"], target=">= 0.9",
            note=f"raw: vLLM at max_lora_rank {RANK} / max_loras 1; greedy tokens {same}"),
        Row("adapter_sampling", f"{case}, vLLM's ops (before)", tps["vllm-64"], tps["raw"], "tok/s",
            ratio=tps["vllm-64"] / tps["raw"], note=f"grouped ops x{tps['ours-64'] / tps['vllm-64']:.2f}"),
    ]


def run(ctx: Context) -> list[Row]:
    rows: list[Row] = []
    for name, model in ctx.models.items():
        rows += _rows(name, model, ctx)
    return rows
