"""Many tenants.

1. Resident: per-step time and memory as the number of resident LoRA models grows. Through the
   SDK against `tinkerd up`: N training clients (rank 8) each take a step and push a sampler
   snapshot, so the trainer holds N adapters with optimizer state and the sampler N snapshots.
   Then a training step round-robin over the N models, and a 16-token sample round-robin over
   the N snapshots. The raw reference is the same step with one resident model.
2. At scale: up to 1,000 rank-8 LoRA models addressable on one trainer that keeps 32 resident
   (`--max-resident-models`; the least recently used go to their durable state on disk) and
   their 1,000 snapshots on one sampler replica (vLLM keeps 64 in memory, `--max-cpu-loras`;
   the others reload from their persisted copies). Models are made by a pool of threads through
   one SDK ServiceClient (create, then save_weights_and_get_sampling_client). At each count:
   the rate models were made at, the services' RSS and open files, the state dir's size, the
   reload latency of an evicted model (its first forward pass, the reload from disk plus the
   pass, less the same pass on a resident model) and the first sample through an evicted
   snapshot next to the same sample through one in memory, p50/p99.

TINKERD_BENCH_TENANTS sets the counts, e.g. `tiny=100,500,1000;smollm2=100` (the default;
`--quick`: `tiny=12`, with 4 models resident and 4 snapshots in memory so that eviction still
happens, both parts on the quick run's shared stack). Merged serving is off in these rows.
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import statistics
import time

from bench.common import Context, Row, disk_mib, median_time, new_dir, percentile, rss_mib, seconds, tinkerd_up
from harness.stack import running_stack, service_pids

TEXT = "the quick brown fox jumps over the lazy dog and the cat sat on the mat"
RESIDENT = 32
CREATORS = 8               # SDK threads making models at once
PROBES = 30                # evicted models (and snapshots) timed per count
CACHED = 64                # snapshots the sampler keeps in memory (--max-cpu-loras)
QUICK_MODELS = 12          # made in the quick run, with 4 resident and 4 snapshots in memory: eviction happens
QUICK_LIMITS = (4, 4)


def _scale_flags(limits: tuple[int, int], counts: tuple[int, ...]) -> tuple[str, ...]:
    """The at-scale stack's flags. Merged serving off: its first promotion (a hot snapshot) builds an
    engine for seconds, which is not what these rows measure."""
    resident, cached = limits
    return ("--max-resident-models", str(resident), "--max-cpu-loras", str(cached), "--max-loras", str(min(8, cached)),
            "--merged-slots", "0", "--max-models-per-user", str(10 * max(counts)))


QUICK_STACK_FLAGS = _scale_flags(QUICK_LIMITS, (QUICK_MODELS,))   # the quick run's shared stack has them


def run(ctx: Context) -> list[Row]:
    if ctx.quick:               # both parts on one stack: the smoke test runs in CI's time
        counts = _scale_counts(ctx)["tiny"]
        with _scale_stack(ctx, "tiny", counts) as stack:
            return _resident_rows(ctx, stack) + _at_scale_rows(ctx, "tiny", counts, stack=stack)
    with running_stack(ctx.models["tiny"], new_dir(ctx, "tenants"), *ctx.stack_flags(ctx.models["tiny"], (
            "--max-loras", "8", "--max-cpu-loras", "64", "--max-models-per-user", str(2 * RESIDENT)))) as stack:
        rows = _resident_rows(ctx, stack)
    for name, counts in _scale_counts(ctx).items():
        if name in ctx.models:
            rows += _at_scale_rows(ctx, name, counts)
    return rows


def _data(model: str):
    from tinker import types
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model).encode(TEXT)
    data = [types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})] * 4
    return ids, data


def _resident_rows(ctx: Context, stack) -> list[Row]:
    import tinker
    from tinker import types

    model = ctx.models["tiny"]
    counts = (1, 4) if ctx.quick else (1, 4, 16, 32)
    ids, data = _data(model)
    prompt = types.ModelInput.from_ints(ids[:8])
    params = types.SamplingParams(max_tokens=16, temperature=0.0, stop=[])
    adam = types.AdamParams(learning_rate=1e-3)
    rows: list[Row] = []
    pids = service_pids(stack.pid)
    service = tinker.ServiceClient(base_url=stack.url)
    trainers, samplers = [], []
    base_step = None
    for n in counts:
        while len(trainers) < n:
            tc = service.create_lora_training_client(base_model=model, rank=8, seed=len(trainers)).result()
            tc.forward_backward(data, "cross_entropy").result()
            tc.optim_step(adam).result()
            trainers.append(tc)
            samplers.append(tc.save_weights_and_get_sampling_client().result())
        turn = iter(range(1 << 30))

        def step():
            tc = trainers[next(turn) % n]
            fb = tc.forward_backward(data, "cross_entropy")
            tc.optim_step(adam).result()
            fb.result()

        def sample():
            samplers[next(turn) % n].sample(prompt, 1, params).result()

        t_step = median_time(step, ctx.iters(3 * n if n < 16 else n, 2), warmup=1)
        t_sample = median_time(sample, ctx.iters(2 * n if n < 16 else n, 2), warmup=1)
        base_step = base_step or t_step
        trainer_mib, sampler_mib = rss_mib(pids["trainer"]), rss_mib(pids["sampler"])
        rows.append(Row("tenants", f"{n} resident adapters: train step (4x{len(ids) - 1} tokens)",
                        1e3 * t_step, 1e3 * base_step, "ms", ratio=base_step / t_step,
                        note=f"trainer RSS {trainer_mib:.0f} MiB"))
        rows.append(Row("tenants", f"{n} resident snapshots: sample 16 tokens", 1e3 * t_sample, None, "ms",
                        note=f"sampler RSS {sampler_mib:.0f} MiB"))
    return rows


def _scale_counts(ctx: Context) -> dict[str, tuple[int, ...]]:
    spec = f"tiny={QUICK_MODELS}" if ctx.quick else os.environ.get("TINKERD_BENCH_TENANTS", "tiny=100,500,1000;smollm2=100")
    out = {}
    for part in filter(None, spec.split(";")):
        name, counts = part.split("=")
        out[name.strip()] = tuple(sorted(int(c) for c in counts.split(",")))
    return out


def _open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _limits(ctx: Context) -> tuple[int, int]:
    """(models resident on the trainer, snapshots in the sampler's memory)."""
    return QUICK_LIMITS if ctx.quick else (RESIDENT, CACHED)


def _scale_stack(ctx: Context, name: str, counts: tuple[int, ...]):
    return tinkerd_up(ctx, f"tenants-scale-{name}", ctx.models[name], *_scale_flags(_limits(ctx), counts))


def _footprint(pids: dict, state: str) -> str:
    """The services' memory and open files, and the state dir's size, as one note."""
    return (f"trainer RSS {rss_mib(pids['trainer']):.0f} MiB, {_open_files(pids['trainer'])} open files; "
            f"sampler RSS {rss_mib(pids['sampler']):.0f} MiB, {_open_files(pids['sampler'])} open files; "
            f"gateway RSS {rss_mib(pids['gateway']):.0f} MiB; state dir {disk_mib(state):.0f} MiB")


def _at_scale_rows(ctx: Context, name: str, counts: tuple[int, ...], report=lambda row: None,
                   stack=None) -> list[Row]:
    """The at-scale rows of `name` (see the module docstring), on `stack` or a stack of their own;
    `report` sees each row as it is made."""
    if stack is None:
        with _scale_stack(ctx, name, counts) as stack:
            return _at_scale_rows(ctx, name, counts, report, stack)
    import tinker
    from tinker import types

    model = ctx.models[name]
    resident, cached = _limits(ctx)
    probes = 3 if ctx.quick else PROBES
    ids, data = _data(model)
    prompt = types.ModelInput.from_ints(ids[:8])
    params = types.SamplingParams(max_tokens=4, temperature=0.0, stop=[])
    state = stack.state_dir
    rows: list[Row] = []
    pids = service_pids(stack.pid)
    service = tinker.ServiceClient(base_url=stack.url)
    trainers: list = []
    samplers: list = []

    def make(seed: int):
        tc = service.create_lora_training_client(base_model=model, rank=8, seed=seed).result()
        return tc, tc.save_weights_and_get_sampling_client().result()

    rng = random.Random(0)
    with concurrent.futures.ThreadPoolExecutor(CREATORS) as pool:
        for n in counts:
            previous, t0 = len(trainers), time.perf_counter()
            for tc, sc in pool.map(make, range(previous, n)):
                trainers.append(tc)
                samplers.append(sc)
            made_s = time.perf_counter() - t0
            # Evicted: any model but the `resident` most recently used (the newest made).
            old = rng.sample(range(n - resident), min(probes, n - resident))
            hot = median_time(lambda: trainers[-1].forward(data, "cross_entropy").result(), 5, warmup=1)
            # The reload itself: an evicted model's first forward less a resident model's forward.
            reload = [seconds(lambda i=i: trainers[i].forward(data, "cross_entropy").result()) - hot for i in old]
            # Snapshots: vLLM keeps the newest `cached` in memory, older ones load from disk.
            warm = median_time(lambda: samplers[-1].sample(prompt, 1, params).result(), 5, warmup=1)
            cold_snaps = rng.sample(range(n - cached), min(probes, n - cached))
            cold = [seconds(lambda i=i: samplers[i].sample(prompt, 1, params).result()) for i in cold_snaps]
            mem = _footprint(pids, state)
            rows.append(Row("tenants", f"{name}: {n} models ({resident} resident), reload of an evicted rank-8 "
                            f"model, p50 (p99 {1e3 * percentile(reload, 0.99):.0f} ms)",
                            1e3 * statistics.median(reload), None, "ms",
                            target="< 1000" if name == "smollm2" else "",
                            note=f"its first forward less a resident model's ({1e3 * hot:.0f} ms); {mem}"))
            rows.append(Row("tenants", f"{name}: {n} snapshots on one replica, first sample through an evicted "
                            f"one, p50 (p99 {1e3 * percentile(cold, 0.99):.0f} ms)",
                            1e3 * statistics.median(cold), 1e3 * warm, "ms",
                            note="raw = the same 4-token sample through a snapshot in memory"))
            rows.append(Row("tenants", f"{name}: models {previous + 1}..{n} made (create + "
                            f"save_weights_and_get_sampling_client, {CREATORS} SDK threads)",
                            (n - previous) / made_s, None, "models/s", note=f"{made_s:.0f} s"))
            for row in rows[-3:]:
                report(row)
    return rows
