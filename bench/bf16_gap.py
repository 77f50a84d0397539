"""Trainer vs sampler logprobs in bf16 (issue 23): |delta logprob| per token, mean and max, on
several texts, through an untrained adapter (LoRA B = 0: the base model) and after SFT steps.

In this process: a TrainerEngine (bf16, a rank-16 adapter; forward_backward(forward_only) gives
its logprobs, cross_entropy + optim_step trains it) and a SamplerEngine (vLLM, bf16; the
adapter registered in the serving dtype, as a weight push does; prompt logprobs as
compute_logprobs asks for them). The same texts and snapshots go through a second trainer built
with match_sampler=False (transformers' own bf16 rounding: what the trainer did before
cpu_numerics.py), the before column. Targets: mean <= 0.01 and max <= 0.05 nats per token.

Measured only where the CPU computes bf16 natively (AVX512-BF16/AMX), the CPUs `--dtype auto`
gives bf16 on: elsewhere a row says it was skipped. The quick run (the smoke test) measures the
tiny model (2 texts, 2 steps; ~25 s), the full run SmolLM2 (6 texts, 10 steps; ~3 min on 2 cores).

Also the snapshots served from merged weights (merged.py: a hot snapshot; by default only in
float32 since these numbers): W + scale * B @ A rounded to bf16, which the trainer's LoRA path cannot match. SmolLM2
after 10 steps: mean 0.056, max 0.88 nats (untrained, B = 0: the LoRA path's 4e-5 / 0.012).
On GPUs the sampler's kernels are others (cpu_numerics.py applies to CPU only); not measured here.

  python -m bench --only bf16_gap          (SmolLM2 when models/smollm2 exists, and the tiny model)
"""

from __future__ import annotations

import dataclasses
import os

import torch

from bench.common import Context, Row

TEXTS = [
    "The quick brown fox jumps over the lazy dog. It was a bright cold day in April, and the clocks were "
    "striking thirteen. Winston Smith, his chin nuzzled into his breast in an effort to escape the vile wind, "
    "slipped quickly through the glass doors of Victory Mansions.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "for i in range(10):\n    print(i, fibonacci(i))\n",
    "Photosynthesis is the process by which green plants and some other organisms use sunlight to synthesize "
    "foods from carbon dioxide and water. It generally involves the green pigment chlorophyll and generates "
    "oxygen as a byproduct.",
    "Question: What is 17 times 23? Answer: 17 times 23 is 391. Question: What is the capital of Australia? "
    "Answer: The capital of Australia is Canberra, not Sydney.",
    "Dear team, the quarterly report is attached. Revenue grew by 12% while costs stayed flat, mostly thanks "
    "to the new supplier contracts signed in March. Please send me your comments before Friday.",
    "In 1905 Albert Einstein published four papers that changed physics: on the photoelectric effect, on "
    "Brownian motion, on special relativity, and on the equivalence of mass and energy.",
]
MAX_TOKENS = 64
RANK, STEPS, LR = 16, 10, 1e-4
MEAN_TARGET, MAX_TARGET = "<= 0.01", "<= 0.05"


@dataclasses.dataclass
class Gap:
    mean: float
    max: float
    tokens: int


def _gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> Gap:
    d = torch.cat([(x - y).abs() for x, y in zip(a, b)])
    return Gap(float(d.mean()), float(d.max()), d.numel())


def _token_ids(model_dir: str, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok(t)["input_ids"][:MAX_TOKENS] for t in TEXTS[:n]]


def _data(seqs: list[list[int]]):
    from trainer_service.training import DatumInput
    return [DatumInput(s[:-1], {"target_tokens": torch.tensor(s[1:])}) for s in seqs]


def _trainer_logprobs(trainer, model_id: str, seqs) -> list[torch.Tensor]:
    outputs, _ = trainer.forward_backward(model_id, _data(seqs), "cross_entropy", {}, forward_only=True)
    return [o["logprobs"] for o in outputs]


def _sampler_logprobs(sampler, snapshot_id: str, seqs) -> list[torch.Tensor]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    futures = [sampler.generate(s, params, 1, snapshot_id) for s in seqs]
    outs = [f.result(600)[0] for f in futures]
    return [torch.tensor([row[t].logprob for row, t in zip(o.prompt_logprobs[1:], s[1:])]) for o, s in zip(outs, seqs)]


def _push(trainer, sampler, model_id: str, snapshot_id: str) -> None:
    """The adapter in the serving dtype, as a weight push sends it (TrainerEngine.snapshot_adapter)."""
    from tinkerd import weight_stream

    packed, config = trainer.snapshot_adapter(model_id)
    tensors = {k: v.clone() for k, v in weight_stream.unpack(packed.specs, packed.chunks).items()}
    sampler.register_snapshot(snapshot_id, tensors, config, "").result(120)


def _promoted(sampler, snapshot_id: str, seq: list[int]) -> None:
    """Asks for the snapshot until the sampler serves it from merged weights (a hot snapshot)."""
    import time

    from vllm import SamplingParams

    deadline = time.monotonic() + 600
    while sampler.served_by(snapshot_id) != "merged":
        if time.monotonic() > deadline:
            raise TimeoutError(f"{snapshot_id} was not promoted to merged serving")
        sampler.generate(seq, SamplingParams(max_tokens=1), 1, snapshot_id).result(600)
        time.sleep(0.05)


def measure(model_dir: str, *, texts: int, steps: int, lr: float = LR, rank: int = RANK,
            merged: bool = False, kv_cache_mib: int = 0) -> dict[str, Gap]:
    """Gaps keyed "untrained" / "trained" (cpu_numerics on, the texts batched on both sides),
    "untrained-alone" / "trained-alone" (each text alone on both sides), "STAGE-trainer-batched" and
    "STAGE-sampler-batched" (each side's batched logprobs against its own text by text: how much
    they move with what shares a batch; the sampler batches the texts' requests as they arrive,
    so its row is 0 when it took them one by one) and "untrained-before" /
    "trained-before" (a trainer with transformers' own rounding, trained alike); with `merged`
    only "untrained-merged" and "trained-merged": the snapshots served from merged weights (merged.py), as the
    sampler serves a hot one."""
    from sampler_service.engine import MergedSettings, SamplerEngine
    from trainer_service.engine import TrainerEngine
    from trainer_service.lora import LoraSpec
    from trainer_service.training import AdamParams

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    seqs = _token_ids(model_dir, texts)
    trainers = {"": TrainerEngine(model_dir, dtype="bfloat16", max_lora_rank=rank)}
    if not merged:
        trainers["-before"] = TrainerEngine(model_dir, dtype="bfloat16", max_lora_rank=rank, match_sampler=False)
    for trainer in trainers.values():
        trainer.create_model("m", LoraSpec(rank=rank, seed=0))
    # Merged serving off unless asked for (the LoRA path is measured); on, every snapshot asked
    # for is promoted at once.
    settings = MergedSettings(slots=1, window=1, share=0.5, min_requests=1) if merged else MergedSettings()
    sampler = SamplerEngine(model_dir, dtype="bfloat16", max_model_len=256, max_num_seqs=16, max_lora_rank=rank,
                            kv_cache_mib=kv_cache_mib,
                            merged=settings)
    adam = AdamParams(learning_rate=lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, grad_clip_norm=0.0)
    gaps: dict[str, Gap] = {}
    try:
        for stage in ("untrained", "trained"):
            for suffix, trainer in trainers.items():
                if stage == "trained":
                    for _ in range(steps):
                        trainer.forward_backward("m", _data(seqs), "cross_entropy", {}, forward_only=False)
                        trainer.optim_step("m", adam)
                snapshot = f"{stage}{suffix}"
                _push(trainer, sampler, "m", snapshot)
                ours = _trainer_logprobs(trainer, "m", seqs)
                if not merged:
                    theirs = _sampler_logprobs(sampler, snapshot, seqs)
                    gaps[snapshot] = _gap(ours, theirs)
                    if not suffix:      # text by text on both sides, and each side against itself
                        ours_alone = [_trainer_logprobs(trainer, "m", [s])[0] for s in seqs]
                        theirs_alone = [_sampler_logprobs(sampler, snapshot, [s])[0] for s in seqs]
                        gaps[f"{stage}-alone"] = _gap(ours_alone, theirs_alone)
                        gaps[f"{stage}-trainer-batched"] = _gap(ours, ours_alone)
                        gaps[f"{stage}-sampler-batched"] = _gap(theirs, theirs_alone)
                else:
                    _promoted(sampler, snapshot, seqs[0])
                    gaps[f"{stage}-merged"] = _gap(ours, _sampler_logprobs(sampler, snapshot, seqs))
    finally:
        sampler.shutdown()
    return gaps


def _rows(name: str, model_dir: str, ctx: Context) -> list[Row]:
    texts, steps = (2, 2) if ctx.quick else (len(TEXTS), STEPS)
    gaps = measure(model_dir, texts=texts, steps=steps, kv_cache_mib=ctx.kv_cache_mib(model_dir))
    rows = []
    for stage, what in (("untrained", "untrained rank-16 adapter (the base model)"),
                        ("trained", f"after {steps} SFT steps at lr {LR:g}")):
        g, before = gaps[stage], gaps[f"{stage}-before"]
        case = f"{name} bf16: {what}, {texts} texts, {g.tokens} tokens"
        alone = gaps[f"{stage}-alone"]
        moved = {side: gaps[f"{stage}-{side}-batched"] for side in ("trainer", "sampler")}
        rows += [
            Row("bf16_gap", f"{case}: mean |Δ logprob|", g.mean, None, "nats/token", target=MEAN_TARGET,
                note=f"before (transformers' own bf16 rounding): mean {before.mean:.4f}"),
            Row("bf16_gap", f"{case}: max |Δ logprob|", g.max, None, "nats/token", target=MAX_TARGET,
                note=f"before: max {before.max:.4f}; batched against itself text by text: " + ", ".join(
                    f"the {side} mean {own.mean:.4f} max {own.max:.4f}" for side, own in moved.items())),
            Row("bf16_gap", f"{case}, each text alone on both sides: max |Δ logprob|", alone.max, None,
                "nats/token", target=MAX_TARGET, note=f"mean {alone.mean:.4f}"),
        ]
    # Also in the quick run: the merged path's code stays exercised (~10 s on the tiny model).
    merged = measure(model_dir, texts=texts, steps=steps, merged=True, kv_cache_mib=ctx.kv_cache_mib(model_dir))
    g = merged["trained-merged"]
    case = f"{name} bf16: after {steps} SFT steps, a hot snapshot served from merged weights, {g.tokens} tokens"
    note = ("merged.py rounds W + scale*B@A to bf16 (deltas under half a bf16 step of W vanish); "
            f"the trainer computes the LoRA path. Untrained (B = 0) merged: mean "
            f"{merged['untrained-merged'].mean:.2g}, max {merged['untrained-merged'].max:.2g}")
    rows += [Row("bf16_gap", f"{case}: mean |Δ logprob|", g.mean, None, "nats/token", target=MEAN_TARGET,
                 note=note),
             Row("bf16_gap", f"{case}: max |Δ logprob|", g.max, None, "nats/token", target=MAX_TARGET)]
    return rows


def _skipped(why: str) -> Row:
    """A row that says what was not measured (its value 0, no target: the smoke test wants finite values)."""
    return Row("bf16_gap", f"skipped: {why}", 0.0, None, "-")


def run(ctx: Context) -> list[Row]:
    from tinkerd import hardware

    if not hardware.native_bf16(gpu=False):
        return [_skipped("this CPU has no native bf16 (AVX512-BF16/AMX), where the gap is measured")]
    rows: list[Row] = []
    for name, model in ctx.models.items():
        if name == "smollm2" or ctx.quick:     # the tiny model: the quick run's check of the code path
            rows += _rows(name, model, ctx)
    if "smollm2" not in ctx.models and not ctx.quick:
        rows.append(_skipped("SmolLM2 (models/smollm2 absent: tinkerd fetch-smollm2 models/smollm2)"))
    return rows
