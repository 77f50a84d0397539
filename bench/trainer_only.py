"""The trainer alone, in process: tinkerd's TrainerEngine step against plain PyTorch + PEFT.

No gateway, sampler, vLLM or SDK: a host with torch, transformers, PEFT and DeepSpeed runs it.
Why: the API benchmarks (train_step) compare through HTTP and gRPC against a raw DeepSpeed
engine; this one asks what the engine itself costs against the simplest correct training loop,
and how far both are from what the card could do (issue 22).

A random-init Llama of the chosen shape is built on the device in the target dtype and saved
once (TrainerEngine loads a model directory). The same LoRA (trainer_service/lora.py: same
targets, rank and alpha as tinkerd) on the same batch, one training step each:
  plain      PEFT + torch AdamW (fused, as the engine's): forward, summed
             cross-entropy in fp32, backward, step, zero_grad
  deepspeed  PEFT under a DeepSpeed ZeRO-2 engine (bench/train_step.raw_step)
  engine     TrainerEngine: forward_backward(cross_entropy) + optim_step, as the servicer calls it
             (--zero-stage 2, the default, which one rank runs as stage 0)
Taken in turn, step by step, so noise hits all alike; medians after warm-up, the clock read
between torch.cuda.synchronize() calls on CUDA.

The physical limit: a LoRA step costs about 4 * params * tokens FLOP (forward 2, the backward's
activation gradients 2; the frozen weights get no weight gradients). params counts the base
model's Linear weights, lm_head included (tied or not: it is a matmul either way); embedding
lookups, attention's quadratic term and LoRA's own small matmuls are left out. Divided by the
matmul rate measured in the same run (8192^3 GEMMs in the run's dtype on CUDA, 1024^3 on CPU),
it is a lower bound on the step; each row says which fraction of it it reaches.

--tenants: the engine alone against an engine holding 31 more models (TENANTS in all) stepping
one of them, and round-robin over all of them. The resident case activates its adapter before
the clock starts, as in the steady state of one model stepping on (the switch is round-robin's).
--group G --prompt P: RL rollouts, every G sequences sharing their first P tokens (a GRPO batch:
one prompt sampled G times); the engine packs them as token trees (trainer_service/prefix_tree.py)
and the added row "engine, padded" runs without. The FLOP bound still counts every token: a
shared prompt computed once can go under it.
--sdk: the same step through the unmodified SDK, the gateway and the trainer's gRPC, with both
services started on the saved model (bench/trainer_services.py: no sampler, so no vLLM needed),
one step at a time and 4 submitted at once, the SDK in a client process of its own
(bench/sdk_client.py). Each row also reports the CPU its processes spent per step; where they
share the cores, the sum over the cores is a floor under the step (bench/host_cores.py).
--host-cores N (CPU only): the last N cores serve (the SDK client, the gateway) and the others
compute (the trainer service and the in-process rows, one thread a core), as a GPU host's CPU
serves while its device computes: then "sdk" against "engine" is what the serving path adds to a
step, without the 2-core host's contention.
--profile: torch.profiler over 3 engine and 3 plain steps (and with --tenants 3 round-robin
steps): top ops by self CPU and CUDA time, kernels per step.

  python -m bench.trainer_only --device cuda --shape 1b --batch 8 --length 512 --rank 32 --dtype bfloat16
  python -m bench.trainer_only --device cpu --shape tiny          (under a minute on 2 shared cores)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import itertools
import json
import os
import platform
import tempfile
import time
from typing import Callable

import torch

from bench.common import check, in_turn
from bench.host_cores import CpuMeter, Split
from bench.trainer_services import trainer_and_gateway

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
            intermediate_size=128, vocab_size=1024, tie_word_embeddings=False)
SHAPES = {
    "tiny": TINY,
    # The tiny model with a 32k vocabulary: a batch's logits then exceed glibc's largest mmap
    # threshold (32 MiB), as a real model's do (bench/allocator.py's test).
    "tiny-wide-vocab": {**TINY, "vocab_size": 32768},
    "smollm2": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True),
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False),
}
TENANTS = 32
ENGINE_TARGET = ">= 0.95"           # plain / engine
RESIDENT_TARGET = ">= 0.95"         # alone / with 31 more resident
ROUND_ROBIN_TARGET = ">= 0.9"       # alone / round-robin over 32
SDK_TARGET = ">= 0.9"               # plain / through the SDK
PIPELINED_TARGET = ">= 1"           # steps submitted at once are no slower than one at a time
PROFILE_STEPS = 3


@dataclasses.dataclass
class Setup:
    device: str = "cpu"
    shape: str = "tiny"
    dtype: str = "float32"
    batch: int = 8
    length: int = 512
    rank: int = 32
    steps: int = 20                 # timed rounds
    warmup: int = 3
    learning_rate: float = 1e-4
    tenants: int = 0                # models on the multi-tenant engine; 0: no tenant rows
    skip_raw: bool = False          # no DeepSpeed row (8b: three 16 GB bases and a step's activations crowd 80 GB)
    profile: bool = False
    group: int = 1                  # >1: rollouts, each `group` datums sharing their first `prompt` tokens
    prompt: int = 0
    sdk: bool = False               # add the steps through the SDK, the gateway and the trainer's gRPC
    max_logits_mib: int | None = None   # the engines' --max-logits-mib; None: the trainer's default
    host_cores: int = 0             # CPU: the last N cores serve, the others compute (bench/host_cores.py)

    @property
    def tokens(self) -> int:
        return self.batch * self.length


@dataclasses.dataclass
class StepRow:
    name: str
    ms: float                       # median per step
    tokens_per_s: float
    of_bound: float                 # the lower bound's share of the step: 1.0 would be the card's limit
    losses: list[float]             # per token, every step in the order taken (warm-up first)


@dataclasses.dataclass
class Report:
    setup: Setup
    machine: str
    linear_params: int
    trainable_params: int
    step_flop: float
    matmul_tflops: float
    bound_ms: float
    rows: list[StepRow]
    ratios: list[dict]              # name, value, target ("" if none), met (None if no target)
    cpu_ms: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)  # row -> process -> CPU ms/step
    cpu_floor_ms: dict[str, float] = dataclasses.field(default_factory=dict)   # CPU runs: row -> CPU's floor
    placement: str = "every process on every core"

    def row(self, name: str) -> StepRow:
        return next(r for r in self.rows if r.name == name)


class Timed:
    """One row's step as a measurement: seconds, the clock read between synchronizations on
    CUDA (else it times kernel launches); the loss per token kept, read after the clock stops."""

    def __init__(self, step: Callable[[], object], tokens: int, cuda: bool,
                 before: Callable[[], object] | None = None, steps_per_call: int = 1):
        self.step, self.tokens, self.cuda, self.before = step, tokens, cuda, before
        self.steps_per_call = steps_per_call        # `step` takes that many steps; seconds are per step
        self.losses: list[float] = []

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def __call__(self) -> float:
        if self.before is not None:
            self.before()
        self._sync()
        t0 = time.perf_counter()
        loss = self.step()
        self._sync()
        seconds = (time.perf_counter() - t0) / self.steps_per_call
        self.losses.append(float(loss) / (self.tokens * self.steps_per_call))
        return seconds


# ---- the model and the batch ------------------------------------------------------------------

def build_model(setup: Setup, out_dir: str) -> torch.nn.Module:
    """The random-init Llama of `setup.shape`, made on the device in the run's dtype (an 8B model
    in fp32 on the CPU first would need 32 GB) and saved to `out_dir` for the engines to load."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**SHAPES[setup.shape], max_position_embeddings=max(2048, setup.length),
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    with torch.device(setup.device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, setup.dtype))
    model.save_pretrained(out_dir)
    return model


def random_batch(setup: Setup, vocab: int) -> list[list[int]]:
    """`batch` sequences of length + 1 tokens: inputs are the first `length`, targets the last.
    With `group` > 1, RL rollouts: every `group` sequences share their first `prompt` tokens."""
    gen = torch.Generator().manual_seed(0)
    sequences = torch.randint(0, vocab, (setup.batch, setup.length + 1), generator=gen)
    if setup.group > 1:
        for start in range(0, setup.batch, setup.group):
            sequences[start:start + setup.group, :setup.prompt] = sequences[start, :setup.prompt]
    return sequences.tolist()


def linear_params(model: torch.nn.Module) -> int:
    """Weights that cost matmuls: every Linear's, lm_head's included even when tied to the embedding."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def matmul_rate(setup: Setup) -> float:
    """FLOP/s of square GEMMs in the run's dtype on this device, measured now (clocks, other jobs)."""
    cuda = setup.device == "cuda"
    n, per_call = (8192, 10) if cuda else (1024, 2)
    a, b = (torch.randn(n, n, device=setup.device, dtype=getattr(torch, setup.dtype)) for _ in range(2))

    def gemms():
        for _ in range(per_call):
            torch.mm(a, b)
        return 0.0
    (seconds,) = in_turn([Timed(gemms, 1, cuda)], rounds=5, warmup=2)
    return 2 * n**3 * per_call / seconds


# ---- the three steps ------------------------------------------------------------------------

ADAM = dict(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)


def plain_step(base: torch.nn.Module, sequences: list[list[int]], setup: Setup) -> Callable[[], torch.Tensor]:
    """The simplest correct LoRA step: PEFT on `base` (tinkerd's targets), torch AdamW."""
    from peft import get_peft_model

    from trainer_service.lora import LoraSpec, linear_groups, peft_config

    base.requires_grad_(False)
    torch.manual_seed(0)        # the engine's adapter is drawn from the same seed
    model = get_peft_model(base, peft_config(linear_groups(base), LoraSpec(rank=setup.rank, seed=0))).eval()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=setup.learning_rate, **ADAM, fused=True)     # as the engine's
    ids = torch.tensor([s[:-1] for s in sequences], device=setup.device)
    targets = torch.tensor([s[1:] for s in sequences], device=setup.device)

    def step() -> torch.Tensor:
        logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def engine_adam(setup: Setup):
    from trainer_service.training import AdamParams

    betas = ADAM["betas"]
    return AdamParams(learning_rate=setup.learning_rate, beta1=betas[0], beta2=betas[1], eps=ADAM["eps"],
                      weight_decay=ADAM["weight_decay"], grad_clip_norm=0.0)


def new_engine(model_dir: str, setup: Setup, model_ids: list[str]):
    """A TrainerEngine on `model_dir` holding rank-`rank` LoRA models `model_ids`, all resident
    (no durable state: nothing is ever evicted; max_resident allows them all anyway)."""
    from trainer_service.engine import TrainerEngine
    from trainer_service.lora import LoraSpec

    logits = {} if setup.max_logits_mib is None else {"max_logits_mib": setup.max_logits_mib}
    engine = TrainerEngine(model_dir, zero_stage=2, dtype=setup.dtype, max_lora_rank=max(64, setup.rank),
                           max_resident=max(TENANTS, len(model_ids)), **logits)
    for model_id in model_ids:
        engine.create_model(model_id, LoraSpec(rank=setup.rank, seed=0))
    return engine


def padded_engine_step(model_dir: str, sequences: list[list[int]], setup: Setup) -> Callable[[], float]:
    """The engine with prefix sharing off (trainer_service/prefix_tree.py): every datum padded."""
    engine = new_engine(model_dir, setup, ["padded"])
    engine.packable = False
    return engine_step(engine, ["padded"], sequences, setup)


def engine_step(engine, model_ids: list[str], sequences: list[list[int]], setup: Setup) -> Callable[[], float]:
    """One step as the servicer runs it, on the next of `model_ids` each call (round-robin)."""
    from trainer_service.training import DatumInput

    data = [DatumInput(s[:-1], {"target_tokens": torch.tensor(s[1:]), "weights": torch.ones(setup.length)})
            for s in sequences]
    adam, turn = engine_adam(setup), itertools.cycle(model_ids)

    def step() -> float:
        model_id = next(turn)
        _, metrics = engine.forward_backward(model_id, data, "cross_entropy", {}, forward_only=False)
        engine.optim_step(model_id, adam)
        return metrics["loss:sum"]
    return step


PIPELINED = 4       # SDK steps submitted at once in the "sdk, 4 at once" row


def sdk_steps(service, model_dir: str, sequences: list[list[int]], setup: Setup, adam=None):
    """(one step, PIPELINED steps) through the unmodified SDK's `service` (a tinker.ServiceClient):
    forward_backward and optim_step submitted, then waited for; PIPELINED such pairs submitted at
    once, as a client that does not wait for each step's metrics does. Each returns its steps'
    summed loss. `adam`: the SDK's AdamParams (default: plain's, ADAM at setup's rate)."""
    from tinker import types

    data = [types.Datum(model_input=types.ModelInput.from_ints(s[:-1]),
                        loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * setup.length}) for s in sequences]
    client = service.create_lora_training_client(base_model=model_dir, rank=setup.rank, seed=0).result()
    betas = ADAM["betas"]
    adam = adam or types.AdamParams(learning_rate=setup.learning_rate, beta1=betas[0], beta2=betas[1],
                                    eps=ADAM["eps"])

    def steps(n: int) -> float:
        pairs = [(client.forward_backward(data, "cross_entropy"), client.optim_step(adam)) for _ in range(n)]
        loss = 0.0
        for fb, op in pairs:
            loss += fb.result().metrics["loss:sum"]
            op.result()
        return loss
    return (lambda: steps(1)), (lambda: steps(PIPELINED))


def raw_deepspeed_step(model_dir: str, sequences: list[list[int]], setup: Setup) -> Callable[[], torch.Tensor]:
    from bench.train_step import raw_step
    return raw_step(model_dir, sequences, setup.dtype, rank=setup.rank)


# ---- measuring ------------------------------------------------------------------------------

def take_in_turn(timed: dict[str, Timed], setup: Setup, bound_ms: float) -> list[StepRow]:
    medians = in_turn(list(timed.values()), setup.steps, setup.warmup)
    return [StepRow(name, 1e3 * s, setup.tokens / s, bound_ms / (1e3 * s), t.losses)
            for (name, t), s in zip(timed.items(), medians)]


def free_memory() -> None:
    """Collects what the caller dropped, and returns the cached GPU memory."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure(setup: Setup) -> Report:
    """Every row of the run (see the module docstring), in one process."""
    split = Split.of(setup.host_cores) if setup.host_cores else None
    with tempfile.TemporaryDirectory(prefix="trainer-only-") as work, \
            (split.computing_here() if split else contextlib.nullcontext()):
        base = build_model(setup, work)
        sequences = random_batch(setup, base.config.vocab_size)
        params = linear_params(base)
        flop = 4.0 * params * setup.tokens
        rate = matmul_rate(setup)
        bound_ms = 1e3 * flop / rate
        engine = new_engine(work, setup, ["alone"])
        with sdk_services(work, sequences, setup, split) as sdk:      # stopped before the tenants' rows
            rows, trainable, cpu_ms = main_rows(base, engine, work, sequences, setup, bound_ms, sdk)
        del base                 # the plain and DeepSpeed models go: room for the tenants
        free_memory()
        if setup.tenants:
            rows += tenant_rows(engine, work, sequences, setup, bound_ms)
    return Report(setup, machine(), params, trainable, flop, rate / 1e12, bound_ms, rows, ratios(rows), cpu_ms,
                  {row: cpu_floor(by_process, split) for row, by_process in cpu_ms.items() if setup.device == "cpu"},
                  split.describe() if split else f"every process on all {len(os.sched_getaffinity(0))} cores")


SIDE = {"bench": "compute", "trainer": "compute", "client": "host", "gateway": "host"}


def cpu_floor(by_process: dict[str, float], split: Split | None) -> float:
    """The shortest step the processes' CPU allows (ms): on each side, their CPU over its cores;
    unsplit, every process on every core."""
    if split is None:
        return sum(by_process.values()) / len(os.sched_getaffinity(0))
    return max(sum(ms for name, ms in by_process.items() if SIDE[name] == side) / len(getattr(split, side))
               for side in ("compute", "host"))


@contextlib.contextmanager
def sdk_services(model_dir: str, sequences: list[list[int]], setup: Setup, split: Split | None = None):
    """With --sdk, the trainer and gateway services on `model_dir` and an SDK client of theirs in a
    process of its own (bench/sdk_client.py; closed before they stop), each on `split`'s cores,
    with the pids of all three; else None."""
    if not setup.sdk:
        yield None
        return
    from bench.sdk_client import SdkClient

    os.environ.setdefault("TINKER_API_KEY", "tml-no-auth")          # the services run with auth off
    logits = () if setup.max_logits_mib is None else ("--max-logits-mib", str(setup.max_logits_mib))
    with trainer_and_gateway(model_dir, setup.dtype, *logits, split=split) as running:
        client = SdkClient(running.url, model_dir, sequences, setup, split.host if split else ())
        try:
            yield client, {"client": client.pid, **running.pids}
        finally:
            client.close()


def main_rows(base: torch.nn.Module, engine, model_dir: str, sequences: list[list[int]], setup: Setup,
              bound_ms: float, sdk=None) -> tuple[list[StepRow], int, dict[str, dict[str, float]]]:
    """plain (LoRA on `base` itself), deepspeed and engine rows (and with `sdk`, sdk_services'
    (SdkClient, pids), the SDK's), the LoRA's parameter count, and each row's CPU per step by
    process."""
    cuda = setup.device == "cuda"
    steps = {"plain": plain_step(base, sequences, setup)}
    if not setup.skip_raw:
        steps["deepspeed"] = raw_deepspeed_step(model_dir, sequences, setup)
    steps["engine"] = engine_step(engine, ["alone"], sequences, setup)
    if setup.group > 1:
        steps["engine, padded"] = padded_engine_step(model_dir, sequences, setup)
    meters = {name: CpuMeter({"bench": os.getpid()}) for name in steps}
    timed = {name: Timed(meters[name].wrap(step), setup.tokens, cuda) for name, step in steps.items()}
    if sdk is not None:
        client, pids = sdk
        for name, n in (("sdk", 1), (f"sdk, {PIPELINED} at once", PIPELINED)):
            meters[name] = CpuMeter(pids)
            timed[name] = Timed(meters[name].wrap(functools.partial(client.steps, n), n), setup.tokens, cuda,
                                steps_per_call=n)
    rows = take_in_turn(timed, setup, bound_ms)
    cpu_ms = {name: meter.ms_per_step() for name, meter in meters.items()}      # before the profiler's steps
    if setup.profile:
        for name in ("engine", "plain"):
            print(profile(name, timed[name], cuda), flush=True)
    return rows, sum(p.numel() for p in base.parameters() if p.requires_grad), cpu_ms


def tenant_rows(alone, model_dir: str, sequences: list[list[int]], setup: Setup, bound_ms: float) -> list[StepRow]:
    """The engine alone, against a second engine holding `tenants` models: stepping one of them,
    and round-robin over all. In turn, step by step, like the main rows. Every tenant takes its
    first step before the clock starts, as in the steady state of tenants training: a model's
    first optim_step makes its AdamW state (two fp32 copies of its adapter; 214 MB for the 1B
    shape's rank 32), and with fewer timed rounds than tenants every round-robin step was one
    (the GPU runs before 2026-12-04: the H100's 0.88x and the H200's 0.835x)."""
    cuda = setup.device == "cuda"
    ids = [f"t{i}" for i in range(setup.tenants)]
    crowded = new_engine(model_dir, setup, ids)
    first = crowded.models.resident(ids[0]).engine.module
    round_robin = engine_step(crowded, ids, sequences, setup)
    for _ in ids:
        round_robin()
    timed = {
        "engine alone": Timed(engine_step(alone, ["alone"], sequences, setup), setup.tokens, cuda),
        f"engine, {setup.tenants - 1} more resident":
            Timed(engine_step(crowded, ids[:1], sequences, setup), setup.tokens, cuda, before=first.activate),
        f"engine, round-robin over {setup.tenants}": Timed(round_robin, setup.tokens, cuda),
    }
    rows = take_in_turn(timed, setup, bound_ms)
    if setup.profile:         # what a switch between tenants costs, against the main rows' engine profile
        name = f"engine, round-robin over {setup.tenants}"
        print(profile(name, timed[name], cuda), flush=True)
    return rows


def ratios(rows: list[StepRow]) -> list[dict]:
    """The figures of merit, each oriented so that higher is better (a time ratio: faster / slower)."""
    ms = {r.name: r.ms for r in rows}
    wanted = [("plain / engine", "plain", "engine", ENGINE_TARGET),
              ("plain / deepspeed", "plain", "deepspeed", ""),
              ("deepspeed / engine", "deepspeed", "engine", ""),
              ("(engine, padded) / engine", "engine, padded", "engine", ""),
              ("plain / sdk", "plain", "sdk", SDK_TARGET),
              (f"sdk / (sdk, {PIPELINED} at once)", "sdk", f"sdk, {PIPELINED} at once", PIPELINED_TARGET)]
    tenant_names = [r.name for r in rows if r.name.startswith("engine, ") and r.name != "engine, padded"]
    targets = (RESIDENT_TARGET, ROUND_ROBIN_TARGET)
    wanted += [(f"alone / ({name})", "engine alone", name, target) for name, target in zip(tenant_names, targets)]
    return [{"name": label, "value": ms[num] / ms[den], "target": target,
             "met": check(ms[num] / ms[den], target) if target else None}
            for label, num, den, target in wanted if num in ms and den in ms]


def machine() -> str:
    from tinkerd.hardware import cpu_flags
    from tinkerd.process import allocator

    flags = cpu_flags()
    kind = next((name for flag, name in (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512-BF16"),
                                         ("avx512f", "AVX-512"), ("avx2", "AVX2")) if flag in flags), "")
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{platform.node()}: {os.cpu_count()} CPUs{f' ({kind})' if kind else ''}, {gpu}, "
            f"torch {torch.__version__}, {allocator()}")


# ---- profile, table, command line -----------------------------------------------------------

def profile(name: str, timed: Timed, cuda: bool) -> str:
    """torch.profiler over PROFILE_STEPS steps: where the time goes, and how many kernels."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profiler(activities=activities) as prof:
        wall = sum(timed() for _ in range(PROFILE_STEPS))
    averages = prof.key_averages()
    lines = [f"### {name}: top 15 ops by self CPU time over {PROFILE_STEPS} steps",
             averages.table(sort_by="self_cpu_time_total", row_limit=15)]
    ops = sum(e.count for e in averages if e.key.startswith("aten::")) / PROFILE_STEPS
    lines.append(f"{name}: {ops:.0f} aten ops per step")
    if cuda:
        lines += [f"### {name}: top 15 ops by CUDA time", averages.table(sort_by="self_device_time_total", row_limit=15)]
        kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA) / PROFILE_STEPS
        launches = sum(e.count for e in averages if "LaunchKernel" in e.key) / PROFILE_STEPS
        lines.append(f"{name}: {kernels:.0f} GPU kernels (and copies) per step, {launches:.0f} launch calls")
        busy = sum(e.self_device_time_total for e in averages) / 1e3 / PROFILE_STEPS
        lines.append(f"{name}: the GPU busy {busy:.1f} ms of the step's {1e3 * wall / PROFILE_STEPS:.1f} ms "
                     f"(under the profiler); where the step synchronizes:")
        lines += [f"  {n} x {site}" for site, n in synchronizations(timed)]
    return "\n".join(lines)


def synchronizations(timed: Timed) -> list[tuple[str, int]]:
    """The code lines where one step waits for the GPU, with how often, the most first: torch's
    sync debug mode warns at each synchronizing call (a device-to-host copy, a host-to-device copy
    from pageable memory, .item()), named here by the innermost frame of tinkerd's own code (the
    bench's for plain PyTorch). Each is a moment the GPU may then idle while Python catches up."""
    import collections
    import traceback
    import warnings

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sites: collections.Counter[str] = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        ours = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(root)]
        served = [f for f in ours if not os.path.relpath(f.filename, root).startswith("bench")]
        where = (served or ours or [None])[-1]
        site = f"{filename}:{lineno}" if where is None else \
            f"{os.path.relpath(where.filename, root)}:{where.lineno} ({where.name})"
        sites[site] += 1

    cuda = torch.cuda.is_available()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            timed.step()
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    return sites.most_common()


def render(report: Report) -> str:
    s = report.setup
    lines = [f"trainer_only: {s.shape} {s.dtype} on {s.device}, {s.batch}x{s.length} tokens, LoRA rank {s.rank}, "
             f"median of {s.steps} steps after {s.warmup} ({report.machine})", f"processes: {report.placement}",
             f"step cost ~ 4 * {report.linear_params / 1e6:.1f}M Linear params * {s.tokens} tokens = "
             f"{report.step_flop / 1e12:.3g} TFLOP; {report.trainable_params / 1e6:.2f}M LoRA params; "
             f"{s.dtype} GEMM {report.matmul_tflops:.3g} TFLOP/s here -> lower bound {report.bound_ms:.3g} ms/step",
             "", "| row | ms/step | tokens/s | of bound | first loss/token |", "|---|---|---|---|---|"]
    for r in report.rows:
        lines.append(f"| {r.name} | {r.ms:.4g} | {r.tokens_per_s:.4g} | {r.of_bound:.1%} | {r.losses[0]:.6f} |")
    if report.cpu_ms:
        ms = {r.name: r.ms for r in report.rows}
        lines += ["", "| row | CPU ms/step, by process | floor from that CPU | step / floor |", "|---|---|---|---|"]
        for name, by_process in report.cpu_ms.items():
            spent = ", ".join(f"{process} {v:.4g}" for process, v in by_process.items())
            floor = report.cpu_floor_ms.get(name)       # on a GPU the step is the device's, not the CPU's
            against = f"{floor:.4g} ms | {ms[name] / floor:.2f}" if floor else " | "
            lines.append(f"| {name} | {spent} | {against} |")
    lines += ["", "| ratio | value | target | verdict |", "|---|---|---|---|"]
    for q in report.ratios:
        verdict = "" if q["met"] is None else ("met" if q["met"] else "MISSED")
        lines.append(f"| {q['name']} | {q['value']:.3f} | {q['target']} | {verdict} |")
    return "\n".join(lines)


def parse_args(argv=None) -> tuple[Setup, str | None]:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="python -m bench.trainer_only", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if cuda else "cpu")
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--steps", type=int, help="timed steps per row, after --warmup (default: 20 on CUDA, 5 on CPU)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--tenants", action="store_true", help=f"add the rows with {TENANTS} models on one engine")
    p.add_argument("--skip-raw", action="store_true", help="leave out the DeepSpeed row (saves one base model)")
    p.add_argument("--profile", action="store_true", help=f"torch.profiler over {PROFILE_STEPS} engine and plain steps")
    p.add_argument("--group", type=int, default=1, help="RL rollouts: every GROUP sequences share a prompt "
                                                         "(adds the engine's row with prefix sharing off)")
    p.add_argument("--prompt", type=int, default=0, help="with --group: the shared prompt's tokens")
    p.add_argument("--sdk", action="store_true", help="add the steps through the SDK, the gateway and the trainer "
                                                      "as services (bench/trainer_services.py; no sampler)")
    p.add_argument("--max-logits-mib", type=int, help="the engines' fp32 logits held at once, past which they go "
                                                       "in recomputed chunks (default: the trainer's)")
    p.add_argument("--host-cores", type=int, default=0,
                   help="CPU: the last N cores run the SDK client and the gateway, the others the trainer and "
                        "the in-process rows, one thread a core (a GPU host's split of serving and compute)")
    p.add_argument("--json", help="also write the report here")
    a = p.parse_args(argv)
    if a.device == "cpu" and cuda:
        p.error("the engine puts its model on the GPU whenever there is one: run with CUDA_VISIBLE_DEVICES=''")
    if a.device == "cuda" and not cuda:
        p.error("no CUDA device here")
    if a.host_cores and a.device != "cpu":
        p.error("--host-cores splits a CPU host's cores; on a GPU the device computes")
    if a.host_cores:
        try:
            Split.of(a.host_cores)
        except ValueError as e:
            p.error(str(e))
    setup = Setup(device=a.device, shape=a.shape, dtype=a.dtype or ("bfloat16" if a.device == "cuda" else "float32"),
                  batch=a.batch, length=a.length, rank=a.rank,
                  steps=a.steps or (20 if a.device == "cuda" else 5), warmup=a.warmup, learning_rate=a.lr,
                  tenants=TENANTS if a.tenants else 0, skip_raw=a.skip_raw, profile=a.profile,
                  group=a.group, prompt=a.prompt, sdk=a.sdk,
                  max_logits_mib=a.max_logits_mib, host_cores=a.host_cores)
    return setup, a.json


def main(argv=None) -> None:
    from transformers.utils import logging as transformers_logging

    setup, json_path = parse_args(argv)
    transformers_logging.disable_progress_bar()      # saving and loading bars, three models' worth
    report = measure(setup)
    print(render(report))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(dataclasses.asdict(report), f, indent=2)


if __name__ == "__main__":
    # The allocator `tinkerd trainer` runs (tinkerd/process.py), for every row: under glibc the
    # step's large blocks are faulted in afresh each step (SmolLM2 bf16, the RL batch: plain
    # 31.7 s and the engine 10.4 s a step under glibc, 16.9 and 7.7 s under tcmalloc).
    from tinkerd.process import reexec_with_tcmalloc
    reexec_with_tcmalloc()
    main()
