"""Training step through the API vs the raw DeepSpeed engine and plain PyTorch, in fp32 and bf16.

Ours: warm forward_backward + optim_step through the SDK against `tinkerd up --dtype D`, one
step at a time (submitted, then waited for), and PIPELINED steps submitted at once, as a client
that does not wait for each step's metrics does; both per step, over PIPELINED steps a sample,
so that both meet the trainer's durable writes alike (one every --durable-interval-s, after an
optim_step: a sample of one step mostly missed it, and the pipelined sample after it paid).
Raw: in this process, the same model in the same dtype with the same LoRA (PEFT; its weights fp32
as PEFT keeps them, as in tinkerd) under a DeepSpeed ZeRO-2 engine with torch AdamW, on the same
batch: forward, cross-entropy sum, engine.backward, engine.step; PyTorch's own kernels.
Plain: the same LoRA with no DeepSpeed, torch AdamW (bench/trainer_only.plain_step).
Measured in turn, step by step, so noise on this shared machine hits all alike. The trainer
is alone on the machine here (the sampler idles), so both get every core (issue 14): the stack
through OMP_NUM_THREADS, the raw engine through torch.set_num_threads. The stack's trainer
writes no durable state for being idle (`--durable-idle-s 0`): idle while the references step,
it would write it then, on their cores (SmolLM2's ~70 MB). Its writes after optim_steps
(--durable-interval-s) still fall in its own steps.
"""

from __future__ import annotations

import os

import torch

from bench.common import Context, Row, in_turn, seconds, tinkerd_up
from bench.trainer_only import PIPELINED, Setup, sdk_steps       # PIPELINED: steps submitted at once

RANK = 16
BATCH, LENGTH = 4, 64
THREADS = os.cpu_count() or 1
DTYPES = ("float32", "bfloat16")
STACK_FLAGS = ("--durable-idle-s", "0")
QUICK_STACK_FLAGS = STACK_FLAGS      # the quick run's shared stack (bench/__main__.py)


def _batch(vocab: int):
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, min(vocab, 1000), (LENGTH + 1,), generator=gen).tolist() for _ in range(BATCH)]


def raw_step(model_dir: str, sequences: list[list[int]], dtype: str = "float32", rank: int = RANK):
    """The raw engine's step, as a function: forward, summed cross-entropy, backward, step; it
    returns the loss (a tensor: reading it would wait for a GPU)."""
    import deepspeed
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from trainer_service.engine import deepspeed_config, init_distributed_once
    from trainer_service.lora import LoraSpec, linear_groups, peft_config

    init_distributed_once()
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    base.requires_grad_(False)
    model = get_peft_model(base, peft_config(linear_groups(base), LoraSpec(rank=rank, seed=0)))
    params = [p for p in model.parameters() if p.requires_grad]
    config = dict(deepspeed_config(2), gradient_accumulation_steps=1)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(params, lr=1e-4), config=config)
    ids = torch.tensor([s[:-1] for s in sequences], device=engine.device)    # DeepSpeed put the model there
    targets = torch.tensor([s[1:] for s in sequences], device=engine.device)

    def step() -> torch.Tensor:
        logits = engine(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
        engine.backward(loss)
        engine.step()
        return loss.detach()
    return step


def plain_step(model_dir: str, sequences: list[list[int]], dtype: str):
    """Plain PyTorch + PEFT's step on the same model, batch and LoRA (no DeepSpeed)."""
    from transformers import AutoModelForCausalLM

    from bench.trainer_only import plain_step as step_of

    setup = Setup(device="cuda" if torch.cuda.is_available() else "cpu", dtype=dtype, batch=BATCH, length=LENGTH,
                  rank=RANK)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(setup.device)
    return step_of(base, sequences, setup)


def api_steps(url: str, model_dir: str, sequences: list[list[int]]):
    """(PIPELINED steps each submitted, then waited for; PIPELINED steps submitted at once, then
    waited for) through the SDK (bench/trainer_only.sdk_steps)."""
    import tinker
    from tinker import types

    one, pipelined = sdk_steps(tinker.ServiceClient(base_url=url), model_dir, sequences,
                               Setup(batch=BATCH, length=LENGTH, rank=RANK), adam=types.AdamParams(learning_rate=1e-4))

    def one_at_a_time():
        for _ in range(PIPELINED):
            one()
    return one_at_a_time, pipelined


def dtype_flags(dtype: str) -> tuple[str, ...]:
    """`tinkerd up` flags for exactly this dtype (auto would pick per machine); a 16-bit dtype on a
    CPU without native bf16 needs the explicit opt-in."""
    from tinkerd.hardware import native_bf16
    return ("--dtype", dtype) + (("--allow-slow-dtype",) if dtype != "float32" and not native_bf16() else ())


def use_threads(n: int) -> None:
    """n threads for the raw engine in this process and for the services of stacks started after."""
    os.environ["OMP_NUM_THREADS"] = str(n)
    torch.set_num_threads(n)


def side_by_side(ctx: Context, name: str, model_dir: str, sequences: list[list[int]], iters: int,
                 dtype: str = "float32", warmup: int = 2) -> tuple[float, float, float, float]:
    """Median seconds per step of (ours one at a time, ours pipelined, raw DeepSpeed, plain),
    measured in turn so all see the same machine: the raw engines run in this process while the
    idle stack waits (~3% of a core), and the other way."""
    with tinkerd_up(ctx, f"train-{name}-{dtype}", model_dir, *dtype_flags(dtype), *STACK_FLAGS) as stack:
        one, pipelined = api_steps(stack.url, model_dir, sequences)
        raw, plain = raw_step(model_dir, sequences, dtype), plain_step(model_dir, sequences, dtype)
        return tuple(in_turn([lambda: seconds(one) / PIPELINED, lambda: seconds(pipelined) / PIPELINED,
                              lambda: seconds(raw), lambda: seconds(plain)], iters, warmup))


NOTES = [
    "train_step bf16 on a CPU without native bf16 (no AVX512-BF16/AMX, e.g. this AVX2-only one): PyTorch's "
    "bf16 GEMM falls back to generic loops, 6-170x slower than fp32 sgemm (one thread, SmolLM2 shapes: an MLP "
    "projection's input gradient 260 ms vs 13 ms; the lm_head's, K = 49152, 66 s vs 0.4 s, most of the raw "
    "step). tinkerd's trainer there computes its frozen bf16 Linear layers as fp32 GEMMs on widened operands "
    "(trainer_service/fp32_gemm.py: the same result as a bf16 GEMM, weights and activations stay bf16), so it "
    "beats the raw bf16 step by a wide margin; the raw reference keeps PyTorch's kernels. On bf16 hardware the "
    "widening is off and both use the native kernels. SmolLM2's raw bf16 step takes ~90 s here (89 s with 2 "
    "threads, 95 s with 1: the fallback loops barely use the second core), so that case runs 2 rounds after 1 "
    "warm-up; tinkerd's took 4.5 s with 2 threads, 7.2 s with 1 (2026-11-23, shared cores, noisy).",
    "train_step, tiny model: the raw step is 13-45 ms depending on the day's VM, and the API path adds a "
    "fixed cost per step on these 2 shared cores (2 HTTP requests + 2 long-polls through the SDK, 2 gRPC "
    "calls, the SDK's own request handling): ~17 ms on the 2026-11-22 VM, ~55 ms on the 2-3x slower one of "
    "2026-11-23 23:51, where every process start and Python-heavy path was slower too (startup rows). "
    "Profiled with py-spy earlier: SQLAlchemy ORM and a 40 ms delayed-ACK stall on every kept-alive response "
    "were removed, 110 -> 30 ms. Against a step of real size (SmolLM2) the same cost is 2-8% and the ratio "
    "meets the target; in bf16 the raw tiny step is slower and the ratio meets it too.",
]


def _rows(ctx: Context, name: str, model: str, dtype: str) -> list[Row]:
    from transformers import AutoConfig

    sequences = _batch(AutoConfig.from_pretrained(model).vocab_size)
    slow_raw = dtype != "float32" and name != "tiny"        # raw bf16 SmolLM2: ~1 min a step on AVX2
    iters = ctx.iters(2 if slow_raw else 15 if name == "tiny" else 8)
    one, pipelined, raw, plain = side_by_side(ctx, name, model, sequences, iters, dtype,
                                              warmup=1 if slow_raw else 2)
    case = f"{name} {dtype}: fwd_bwd+optim, {BATCH}x{LENGTH} tokens, rank {RANK}, {THREADS} threads"
    return [Row("train_step", case, 1e3 * one, 1e3 * raw, "ms", ratio=raw / one, target=">= 0.9"),
            Row("train_step", f"{case}; raw = plain PyTorch + PEFT", 1e3 * one, 1e3 * plain, "ms",
                ratio=plain / one, target=">= 0.9"),
            Row("train_step", f"{case}; {PIPELINED} steps submitted at once, per step (raw = one at a time)",
                1e3 * pipelined, 1e3 * one, "ms", ratio=one / pipelined, target=">= 1")]


def run(ctx: Context) -> list[Row]:
    use_threads(THREADS)
    # The smoke run (--quick) skips bf16: the same code path with another dtype, and a second stack
    # start; tests/trainer/test_bf16_training.py trains in bf16 in CI.
    dtypes = DTYPES[:1] if ctx.quick else DTYPES
    return [row for name, model in ctx.models.items() for dtype in dtypes for row in _rows(ctx, name, model, dtype)]
