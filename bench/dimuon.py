"""Dimuon against AdamW on one TrainerEngine: what a step costs, and how well each learns an SFT task
at its own learning rate.

Cost: an AdamW model and a Dimuon model of the same LoRA rank on one engine take training steps
(forward_backward of BATCH x LENGTH tokens + optim_step) in turn, as the servicer runs them, on
every core; the figure is AdamW's step over Dimuon's (target >= 1/1.1: a Dimuon step costs at most
1.1x an AdamW step), per dtype (bf16 only where the CPU has it natively) and rank. The optim_step
alone is in the note: Newton-Schulz is a few dozen small matrix products and a float64 Gram matrix
per LoRA matrix, where AdamW is one fused elementwise kernel, so alone it costs several AdamW steps.
Where models/smollm2 is absent, a random-init model of SmolLM2's shape stands in for the cost.

Learning: SFT on a chat task (sums of two numbers; the prompt weighted 0, the answer 1), one epoch
of the same batches for both, LEARN_STEPS steps at each learning rate of a grid per optimizer
(LR_GRIDS: each at its own scale); the figure is AdamW's best held-out loss per answer token over
Dimuon's best, target >= 0.9 ("about as well"); the note has every run and where each was best.

  python -m bench --only dimuon          (the tiny model; SmolLM2 too when models/smollm2 exists)
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

import torch

from bench.common import Context, Row, in_turn

BATCH, LENGTH = 4, 64
RANKS = (8, 32)
DTYPES = ("float32", "bfloat16")
COST_TARGET = f">= {1 / 1.1:.3f}"          # AdamW's step / Dimuon's: Dimuon's at most 1.1x
LEARN_TARGET = ">= 0.9"                   # AdamW's best loss / Dimuon's
LEARN_RANK, LEARN_STEPS, LEARN_BATCH = 32, 60, 8
TRAIN_EXAMPLES, HELD_OUT = 480, 64
# Each optimizer's learning rates, the same ratios (1, 2, 4, 10, 20) around its best: Dimuon moves
# each matrix by lr * sqrt(rank), AdamW each entry by about lr, so Dimuon's best is some
# sqrt(layer width) times AdamW's.
LR_GRIDS = {"tiny": {"adamw": [5e-4, 1e-3, 2e-3, 5e-3, 1e-2], "dimuon": [5e-3, 1e-2, 2e-2, 5e-2, 1e-1]},
            "smollm2": {"adamw": [1e-4, 2e-4, 5e-4, 1e-3, 2e-3], "dimuon": [2e-3, 5e-3, 1e-2, 2e-2, 5e-2]}}
THREADS = os.cpu_count() or 1            # a trainer alone on its host computes on every core (tinkerd/cores.py)


@dataclasses.dataclass
class Cost:
    step_ms: dict[str, float]               # optimizer -> median training step
    optim_ms: dict[str, float]              # optimizer -> median optim_step alone


def _engine(model_dir: str, dtype: str, rank: int, optimizers=("adamw", "dimuon")):
    from trainer_service.engine import TrainerEngine
    from trainer_service.lora import LoraSpec

    engine = TrainerEngine(model_dir, zero_stage=2, dtype=dtype, max_lora_rank=max(64, rank))
    for name in optimizers:
        engine.create_model(name, LoraSpec(rank=rank, seed=0, optimizer=name))
    return engine


def _params(optimizer: str, lr: float):
    from trainer_service.engine import AdamParams, DimuonParams

    if optimizer == "dimuon":
        return DimuonParams(learning_rate=lr, beta1=0.9, damping=1e-4, rank_lr_correction_exponent=0.175,
                            grad_clip_norm=0.0)
    return AdamParams(learning_rate=lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, grad_clip_norm=0.0)


def _random_data(vocab: int):
    from trainer_service.training import DatumInput

    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, min(vocab, 1000), (LENGTH + 1,), generator=gen).tolist() for _ in range(BATCH)]
    return [DatumInput(s[:-1], {"target_tokens": torch.tensor(s[1:]), "weights": torch.ones(LENGTH)}) for s in seqs]


def step_cost(model_dir: str, dtype: str, rank: int, rounds: int, warmup: int = 3) -> Cost:
    """Median ms of a training step and of its optim_step alone, AdamW's and Dimuon's taken in turn."""
    from transformers import AutoConfig

    engine = _engine(model_dir, dtype, rank)
    data = _random_data(AutoConfig.from_pretrained(model_dir).vocab_size)
    optim: dict[str, list[float]] = {"adamw": [], "dimuon": []}

    def timed(name: str):
        params = _params(name, 1e-5)

        def step() -> float:
            t0 = time.perf_counter()
            engine.forward_backward(name, data, "cross_entropy", {}, forward_only=False)
            t1 = time.perf_counter()
            engine.optim_step(name, params)
            t2 = time.perf_counter()
            optim[name].append(t2 - t1)
            return t2 - t0
        return step

    adamw, dimuon = in_turn([timed("adamw"), timed("dimuon")], rounds, warmup)
    return Cost({"adamw": 1e3 * adamw, "dimuon": 1e3 * dimuon},
                {k: 1e3 * statistics.median(v[warmup:]) for k, v in optim.items()})


def cost_rows(name: str, model_dir: str, ctx: Context) -> list[Row]:
    from tinkerd.hardware import native_bf16

    rows = []
    for dtype in DTYPES[:1] if ctx.quick else DTYPES:
        if dtype != "float32" and not native_bf16(gpu=False):
            continue            # bf16 GEMMs are generic loops there: the forward, not the optimizer, is measured
        for rank in RANKS[-1:] if ctx.quick else RANKS:
            c = step_cost(model_dir, dtype, rank, ctx.iters(40 if name == "tiny" else 6))
            note = (f"optim_step alone {c.optim_ms['adamw']:.2f} / {c.optim_ms['dimuon']:.2f} ms "
                    f"(x{c.optim_ms['dimuon'] / c.optim_ms['adamw']:.2f})")
            rows.append(Row("dimuon", f"{name} {dtype} r{rank}: step, {BATCH}x{LENGTH} tokens (ours Dimuon, raw AdamW)",
                            c.step_ms["dimuon"], c.step_ms["adamw"], "ms",
                            ratio=c.step_ms["adamw"] / c.step_ms["dimuon"], target=COST_TARGET, note=note))
    return rows


# ---- learning an SFT task --------------------------------------------------------------------

@dataclasses.dataclass
class Learned:
    optimizer: str
    lr: float
    train: float                    # loss per answer token after the steps, on the training examples
    held_out: float                 # on examples it never saw


def sft_examples(model_dir: str, n: int, seed: int):
    """`n` chat examples of the task (a sum of two numbers under 50), the prompt weighted 0 and the
    answer with its end-of-turn marker 1, as an SFT recipe renders them."""
    import random

    from transformers import AutoTokenizer

    from trainer_service.training import DatumInput

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rng, data = random.Random(seed), []
    for _ in range(n):
        a, b = rng.randrange(50), rng.randrange(50)
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": f"What is {a} plus {b}?"}],
                                               tokenize=False, add_generation_prompt=True)
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        answer = tokenizer(str(a + b), add_special_tokens=False)["input_ids"] + [end]
        tokens, weights = ids + answer, [0.0] * len(ids) + [1.0] * len(answer)
        data.append(DatumInput(tokens[:-1], {"target_tokens": torch.tensor(tokens[1:]),
                                             "weights": torch.tensor(weights[1:])}))
    return data


def _loss_per_token(engine, model_id: str, data) -> float:
    _, metrics = engine.forward_backward(model_id, data, "cross_entropy", {}, forward_only=True)
    return metrics["loss:sum"] / sum(float(d.loss_fn_inputs["weights"].sum()) for d in data)


def learn(engine, model_dir: str, optimizer: str, lr: float, rank: int, steps: int, batch: int,
          train, held_out) -> Learned:
    """A fresh model (seed 0, the same init for every run) trained `steps` steps over `train` in
    batches of `batch`, then its loss on `train` and `held_out`."""
    from trainer_service.lora import LoraSpec

    model_id = f"{optimizer}-{lr:g}"
    engine.create_model(model_id, LoraSpec(rank=rank, seed=0, optimizer=optimizer))
    params = _params(optimizer, lr)
    for step in range(steps):
        start = step * batch % len(train)
        engine.forward_backward(model_id, train[start:start + batch], "cross_entropy", {}, forward_only=False)
        engine.optim_step(model_id, params)
    result = Learned(optimizer, lr, _loss_per_token(engine, model_id, train),
                     _loss_per_token(engine, model_id, held_out))
    engine.delete_model(model_id)
    return result


def learn_rows(name: str, model_dir: str, ctx: Context) -> list[Row]:
    """Each optimizer over its grid, the best final held-out loss of each."""
    grids = LR_GRIDS[name] if not ctx.quick else {k: v[1:2] for k, v in LR_GRIDS[name].items()}
    steps = ctx.iters(LEARN_STEPS, 2)
    engine = _engine(model_dir, "float32", LEARN_RANK, optimizers=())
    train, held_out = sft_examples(model_dir, TRAIN_EXAMPLES, seed=0), sft_examples(model_dir, HELD_OUT, seed=1)
    before = _loss_per_token_fresh(engine, held_out)
    runs = [learn(engine, model_dir, opt, lr, LEARN_RANK, steps, LEARN_BATCH, train, held_out)
            for opt, grid in grids.items() for lr in grid]
    best = {opt: min((r for r in runs if r.optimizer == opt), key=lambda r: r.held_out) for opt in grids}
    adamw, dimuon = best["adamw"], best["dimuon"]
    swept = "; ".join(f"{r.optimizer} {r.lr:g}: {r.train:.3f} / {r.held_out:.3f}" for r in runs)
    edge = [opt for opt, r in best.items() if len(grids[opt]) > 1 and r.lr in (grids[opt][0], grids[opt][-1])]
    note = (f"untrained {before:.3f}; best lr adamw {adamw.lr:g}, dimuon {dimuon.lr:g}; train loss "
            f"{adamw.train:.3f} / {dimuon.train:.3f}; every run (train / held-out): {swept}"
            + (f"; best at the grid's edge: {', '.join(edge)}" if edge else ""))
    return [Row("dimuon", f"{name} SFT, {steps} steps of {LEARN_BATCH}, r{LEARN_RANK}: held-out loss per answer "
                f"token at its best lr (ours Dimuon, raw AdamW)", dimuon.held_out, adamw.held_out, "nats",
                ratio=adamw.held_out / dimuon.held_out, target=LEARN_TARGET, note=note)]


def _loss_per_token_fresh(engine, data) -> float:
    """The loss of an untrained adapter (LoRA B = 0: the base model's)."""
    from trainer_service.lora import LoraSpec

    engine.create_model("untrained", LoraSpec(rank=LEARN_RANK, seed=0))
    try:
        return _loss_per_token(engine, "untrained", data)
    finally:
        engine.delete_model("untrained")


def smollm2_shaped(ctx: Context) -> str:
    """A random-init Llama of SmolLM2's shape (bench/trainer_only.py), for the cost rows where
    models/smollm2 is absent: what a step costs does not depend on the weights."""
    import os

    from bench.trainer_only import Setup, build_model

    path = os.path.join(ctx.work_dir, "smollm2-shaped")
    if not os.path.isfile(os.path.join(path, "config.json")):
        build_model(Setup(shape="smollm2"), path)
    return path


def run(ctx: Context) -> list[Row]:
    torch.set_num_threads(THREADS)
    rows: list[Row] = []
    for name, model in ctx.models.items():
        rows += learn_rows(name, model, ctx)
        rows += cost_rows(name, model, ctx)
    if "smollm2" not in ctx.models and not ctx.quick:
        rows += cost_rows("SmolLM2-shaped (random weights)", smollm2_shaped(ctx), ctx)
    return rows


if __name__ == "__main__":
    import sys

    from bench.common import tiny_model

    work = sys.argv[1] if len(sys.argv) > 1 else "/tmp/dimuon-bench"
    for r in run(Context(quick=False, work_dir=work, models={"tiny": tiny_model(work)})):
        print(r)
