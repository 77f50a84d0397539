"""Loads an exported checkpoint the way a user elsewhere would, with nothing of tinkerd, and
prints the per-position logprobs of each prompt's tokens as JSON (the last stdout line).

    python export_loaders.py JOBS_JSON PROMPTS_JSON      JOBS: [[LOADER, BASE_DIR, EXPORT_DIR], ...]

Several loads share one process (transformers' first, then vLLM's, each engine freed before the
next): a process start with vLLM's imports costs more than the loads themselves.

LOADER: `peft` (PeftModel.from_pretrained over the base), `vllm-lora` (vanilla vLLM's LoRA path:
LLM(enable_lora=True) + LoRARequest), `hf-merged` and `vllm-merged` (the merged export as a plain
model; BASE_DIR unused). Run as a subprocess by test_export_parity.py: vLLM in process keeps
process-wide state (its torch.distributed group) the test process must not inherit.
vllm-lora sends each prompt in a generate call of its own: vLLM 0.32's prompt logprobs through an
lm_head LoRA fail when requests of different lengths share a batch (`vllm-lora-batched` shows
it; docs/compatibility.md). The merged export has no LoRA: `vllm-merged` sends them all at once.
"""

from __future__ import annotations

import json
import os
import sys


def _transformers(model_dir: str, adapter_dir: str | None, prompts: list[list[int]]) -> list[list[float]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            logits = model(input_ids=torch.tensor([p])).logits[0].float()
            lp = torch.log_softmax(logits, dim=-1)[:-1].gather(1, torch.tensor(p[1:]).unsqueeze(1)).squeeze(1)
            out.append(lp.tolist())
    return out


def _vllm(model_dir: str, adapter_dir: str | None, prompts: list[list[int]], *,
          batched: bool = False) -> list[list[float]]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    lora = {}
    if adapter_dir is not None:
        with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
            rank = json.load(f)["r"]
        lora = dict(enable_lora=True, max_lora_rank=max(8, rank), max_loras=1)
    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=256, seed=0, **lora)
    request = LoRARequest("exported", 1, adapter_dir) if adapter_dir is not None else None
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    groups = [prompts] if batched else [[p] for p in prompts]
    results = [r for group in groups for r in llm.generate([{"prompt_token_ids": p} for p in group], params,
                                                           lora_request=request, use_tqdm=False)]
    del llm
    _free_vllm()
    return [[entry[token].logprob for token, entry in zip(p[1:], r.prompt_logprobs[1:])]
            for p, r in zip(prompts, results)]


def _free_vllm() -> None:
    """The engine's memory and its process-wide group released, so the next LLM() starts afresh."""
    import gc

    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    cleanup_dist_env_and_memory()
    gc.collect()


def load(loader: str, base_dir: str, export_dir: str, prompts: list[list[int]]) -> list[list[float]]:
    if loader == "peft":
        return _transformers(base_dir, export_dir, prompts)
    if loader == "hf-merged":
        return _transformers(export_dir, None, prompts)
    if loader == "vllm-lora":
        return _vllm(base_dir, export_dir, prompts)
    if loader == "vllm-lora-batched":
        return _vllm(base_dir, export_dir, prompts, batched=True)
    if loader == "vllm-merged":
        return _vllm(export_dir, None, prompts, batched=True)
    raise SystemExit(f"unknown loader {loader!r}")


def main(jobs: list[list[str]], prompts: list[list[int]]) -> list[list[list[float]]]:
    order = sorted(range(len(jobs)), key=lambda i: jobs[i][0].startswith("vllm"))     # transformers first
    results: dict[int, list[list[float]]] = {i: load(*jobs[i], prompts) for i in order}
    return [results[i] for i in range(len(jobs))]


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]), json.loads(sys.argv[2]))))
