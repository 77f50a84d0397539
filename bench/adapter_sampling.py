"""Sampling through one LoRA adapter (rank 8 and 32): vLLM's CPU LoRA ops vs our grouped ones,
and a hot snapshot served from merged weights vs raw vLLM on the base model (issue 14).

All three in this process, on vllm.LLM with the adapter from a PEFT directory (LoRARequest),
greedy, ignore EOS, the same prompts; rounds alternate among them:
  raw      vLLM configured for just this adapter (max_lora_rank=rank, max_loras=1), its own ops;
  vllm-64  vLLM as our sampler starts it (max_lora_rank=64, max_loras=4), vLLM's own ops: every
           token gathers a whole rank-64 matrix per LoRA layer (before);
  ours-64  the same engine with our CPU LoRA path installed (after: sampler_service/grouped_lora.py,
           put in place by worker_ext.patch_cpu_punica_ops, as the sampler does).
The swap is process-global and the engine runs in this process, so vllm-64 and ours-64 are one
engine with the path swapped between runs. The figure of merit is ours-64 / raw.

Merged: our SamplerEngine (LoRA engine + one merged slot, as the sampler runs it) with the rank-8
snapshot promoted, every request through SamplerEngine.generate, against raw vLLM without LoRA on
the base model: the same generation, alternating rounds. Also the promotion's latency (first
request to merged serving, including the slot engine's creation), a re-merge's, and the RSS.
"""

from __future__ import annotations

import concurrent.futures
import os
import statistics
import time

import torch

from bench.common import Context, Row, new_dir, raw_kv_cache, rss_mib

PROMPT_LEN, MAX_TOKENS, N_SEQS, RANKS = 16, 64, 8, (8, 32)


def _prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(5, 1000, (PROMPT_LEN,), generator=gen).tolist() for _ in range(n)]


def _engine(model_dir: str, max_lora_rank: int = 0, max_loras: int = 0, kv_cache_mib: int = 0):
    """vllm.LLM as the sampler configures it; LoRA off when max_loras is 0."""
    from vllm import LLM
    lora = dict(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=max_loras) if max_loras else {}
    return LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=1024, max_num_seqs=64,
               seed=0, **lora, **raw_kv_cache(kv_cache_mib))


def _ops(grouped: bool) -> None:
    """Our CPU LoRA path (what the sampler installs) or vLLM's own."""
    from sampler_service import worker_ext
    (worker_ext.patch_cpu_punica_ops if grouped else worker_ext.unpatch_cpu_punica_ops)()


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


def measure(model_dir: str, adapter: str, rank: int, prompts, max_tokens: int, rounds: int,
            kv_cache_mib: int = 0) -> tuple[dict, dict]:
    """Median tokens/s of raw, vllm-64 and ours-64 (rounds in turn), and each one's greedy tokens."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    raw, ours = _engine(model_dir, rank, 1, kv_cache_mib), _engine(model_dir, 64, 4, kv_cache_mib)
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


def _rows(name: str, model_dir: str, ctx: Context, rank: int) -> list[Row]:
    from harness.models import build_lora_adapter

    adapter = str(build_lora_adapter(model_dir, new_dir(ctx, f"adapter-{name}-r{rank}"), rank=rank))
    n, max_tokens = (2, 8) if ctx.quick else (N_SEQS, MAX_TOKENS)
    tps, seen = measure(model_dir, adapter, rank, _prompts(n), max_tokens, ctx.iters(3, 1), ctx.kv_cache_mib(model_dir))
    same = "identical" if seen["ours-64"] == seen["vllm-64"] == seen["raw"] else "DIFFER"
    case = f"{name}: rank-{rank} adapter, {n}x{max_tokens} tokens, max_lora_rank 64 / max_loras 4"
    return [
        Row("adapter_sampling", f"{case}, grouped ops", tps["ours-64"], tps["raw"], "tok/s",
            ratio=tps["ours-64"] / tps["raw"], target=">= 0.9",
            note=f"raw: vLLM at max_lora_rank {rank} / max_loras 1; greedy tokens {same}"),
        Row("adapter_sampling", f"{case}, vLLM's ops (before)", tps["vllm-64"], tps["raw"], "tok/s",
            ratio=tps["vllm-64"] / tps["raw"], note=f"grouped ops x{tps['ours-64'] / tps['vllm-64']:.2f}"),
    ]


def measure_merged(model_dir: str, adapters: list[str], prompts, max_tokens: int, rounds: int,
                   kv_cache_mib: int = 0) -> dict:
    """Tokens/s of a promoted snapshot through SamplerEngine and of raw vLLM on the base model
    (medians of alternating rounds), the promotion and re-merge latencies, RSS and greedy tokens."""
    from vllm import SamplingParams

    from sampler_service.engine import MergedSettings, SamplerEngine
    from sampler_service.merged import read_adapter

    rss0 = rss_mib(os.getpid())
    ours = SamplerEngine(model_dir, dtype="float32", max_model_len=1024, max_num_seqs=64, kv_cache_mib=kv_cache_mib,
                         merged=MergedSettings(slots=1, window=1, share=0.5, min_requests=1))
    rss_lora = rss_mib(os.getpid())
    for i, path in enumerate(adapters):
        ours.register_snapshot(f"s{i}", *read_adapter(path), path).result(120)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    seen: dict = {}

    def promote(snapshot_id: str) -> float:
        t0 = time.perf_counter()
        ours.generate(prompts[0], SamplingParams(max_tokens=1), 1, snapshot_id).result(600)
        while ours.served_by(snapshot_id) != "merged":
            time.sleep(0.01)
        return time.perf_counter() - t0

    first = promote("s0")
    rss_merged = rss_mib(os.getpid())
    remerge = promote("s1") if len(adapters) > 1 else float("nan")
    hot = f"s{len(adapters) - 1}"
    raw = _engine(model_dir, kv_cache_mib=kv_cache_mib)
    inputs = [{"prompt_token_ids": p} for p in prompts]

    def run_ours() -> float:
        t0 = time.perf_counter()
        futures = [ours.generate(p, params, 1, hot) for p in prompts]
        outs = [f.result(600)[0] for f in futures]
        elapsed = time.perf_counter() - t0
        assert ours.served_by(hot) == "merged"
        seen["merged"] = [list(o.outputs[0].token_ids) for o in outs]
        return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed

    def run_raw() -> float:
        t0 = time.perf_counter()
        outs = raw.generate(inputs, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed

    run_ours(), run_raw()                     # warm-up
    times = {"merged": [], "raw": []}
    for _ in range(rounds):
        times["merged"].append(run_ours())
        times["raw"].append(run_raw())
    # The LoRA engine on the same snapshot, same tokens? (greedy; fp32 merged vs LoRA differ by rounding)
    ours._submit("demote", (0, hot)).result(60)
    lora_out = [f.result(600)[0] for f in [ours.generate(p, params, 1, hot) for p in prompts]]
    seen["lora"] = [list(o.outputs[0].token_ids) for o in lora_out]
    ours.shutdown()
    return {"merged": statistics.median(times["merged"]), "raw": statistics.median(times["raw"]),
            "promote_s": first, "remerge_s": remerge, "rss_lora_mib": rss_lora - rss0,
            "rss_slot_mib": rss_merged - rss_lora, "same": seen["merged"] == seen["lora"]}


def _merged_rows(name: str, model_dir: str, ctx: Context) -> list[Row]:
    from harness.models import build_lora_adapter

    adapters = [str(build_lora_adapter(model_dir, new_dir(ctx, f"adapter-{name}-merged{i}"), rank=8, seed=i))
                for i in range(2)]
    n, max_tokens = (2, 8) if ctx.quick else (N_SEQS, MAX_TOKENS)
    r = measure_merged(model_dir, adapters, _prompts(n), max_tokens, ctx.iters(3, 1), ctx.kv_cache_mib(model_dir))
    return [Row("adapter_sampling", f"{name}: hot rank-8 snapshot served merged, {n}x{max_tokens} tokens",
                r["merged"], r["raw"], "tok/s", ratio=r["merged"] / r["raw"], target=">= 0.9",
                note=(f"raw: vLLM without LoRA on the base model; promotion {r['promote_s']:.1f} s (slot engine "
                      f"created), re-merge {r['remerge_s']:.2f} s; RSS: LoRA engine +{r['rss_lora_mib']:.0f} MiB, "
                      f"merged slot +{r['rss_slot_mib']:.0f} MiB; greedy tokens vs LoRA serving "
                      f"{'identical' if r['same'] else 'differ (fp32 rounding)'}"))]


def run(ctx: Context) -> list[Row]:
    rows: list[Row] = []
    # The smoke run (--quick) takes one rank: the other is the same path with another number
    # (this benchmark's smoke run 36 -> 31 s alone).
    for name, model in ctx.models.items():
        for rank in RANKS[:1] if ctx.quick else RANKS:
            rows += _rows(name, model, ctx, rank)
        rows += _merged_rows(name, model, ctx)
    return rows
