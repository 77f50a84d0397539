"""A long RL run: does anything grow without bound?

One SDK client runs the loop users run for hours (sample with the newest sampling client, train
on the samples, optim_step, save_weights_and_get_sampling_client) against `tinkerd up` on the tiny
model, with the retentions shortened so that a few minutes stand for days: finished futures kept
20 s (`--futures-retention-s`), superseded snapshots 10 s (`--superseded-snapshot-retention-s`).
Every few seconds it records the services' RSS, the state dir's size, the snapshot directories,
and the futures and sampling-session rows. Pruning runs every 30 s, so disk and rows go up and
down in a sawtooth; each row compares the peak of the run's second half with the peak of its
first: ratio = first / second, about 1 when bounded, lower when still growing. That needs several
teeth in each half, so the run lasts at least MIN_SECONDS whatever its step count (400 steps took
250 s on 2026-11-23 and 76 s on 2026-11-29: 2.5 teeth, whose halves compare a low with a high).
Memory of a Python process creeps (allocator arenas, vLLM's caches warming), so the memory target
is looser than the disk and row targets, where anything above a constant is a leak.

TINKERD_BENCH_SOAK_STEPS sets the loop's least length (default 400; `--quick`: 4, on the run's shared
stack, whose other benchmarks' snapshots and futures count too), TINKERD_BENCH_SOAK_S its least
duration (default MIN_SECONDS; `--quick`: 0).
"""

from __future__ import annotations

import os
import sqlite3
import time

from bench.common import Context, Row, disk_mib, rss_mib, tinkerd_up
from harness.stack import service_pids

FUTURES_RETENTION_S = 20
SUPERSEDED_RETENTION_S = 10
SAMPLES = 4
TOKENS = 16
PRUNE_EVERY_S = 30         # the gateway's pruning round
MIN_SECONDS = 10 * PRUNE_EVERY_S
PROBE_EVERY_S = 3.0
RETENTION_FLAGS = ("--futures-retention-s", str(FUTURES_RETENTION_S),
                   "--superseded-snapshot-retention-s", str(SUPERSEDED_RETENTION_S))
QUICK_STACK_FLAGS = RETENTION_FLAGS     # the quick run's shared stack has them (bench/__main__.py)


def run(ctx: Context) -> list[Row]:
    steps = 4 if ctx.quick else int(os.environ.get("TINKERD_BENCH_SOAK_STEPS", "400"))
    min_s = 0.0 if ctx.quick else float(os.environ.get("TINKERD_BENCH_SOAK_S", MIN_SECONDS))
    with tinkerd_up(ctx, "soak", ctx.models["tiny"], *RETENTION_FLAGS) as stack:
        series, seconds = _loop(ctx.models["tiny"], stack, steps, min_s)
    return _rows(series, seconds)


def _loop(model: str, stack, steps: int, min_s: float) -> tuple[list[dict], float]:
    import tinker
    from tinker import types

    pids = service_pids(stack.pid)
    service = tinker.ServiceClient(base_url=stack.url)
    tc = service.create_lora_training_client(base_model=model, rank=8).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints([5, 17, 300, 42, 9, 88, 120, 7])
    params = types.SamplingParams(max_tokens=TOKENS, temperature=1.0)
    adam = types.AdamParams(learning_rate=1e-4)
    series: list[dict] = []
    t0, step, probe_at = time.perf_counter(), 0, 0.0
    while step < steps or time.perf_counter() - t0 < min_s:
        step += 1
        out = sampler.sample(prompt, SAMPLES, params).result()
        data = []
        for seq in out.sequences:
            tokens = prompt.to_ints() + list(seq.tokens)
            data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                    loss_fn_inputs={"target_tokens": tokens[1:],
                                                    "weights": [0.0] * (len(prompt.to_ints()) - 1) + [1.0] * len(seq.tokens)}))
        fb = tc.forward_backward(data, "cross_entropy")
        tc.optim_step(adam).result()
        fb.result()
        sampler = tc.save_weights_and_get_sampling_client().result()
        if (elapsed := time.perf_counter() - t0) >= probe_at:
            series.append(_footprint(step, elapsed, pids, stack.state_dir))
            probe_at = elapsed + PROBE_EVERY_S
    seconds = time.perf_counter() - t0
    if series[-1]["step"] != step:
        series.append(_footprint(step, seconds, pids, stack.state_dir))
    return series, seconds


def _footprint(step: int, elapsed: float, pids: dict, state: str) -> dict:
    snapshots = os.path.join(state, "snapshots")
    db = sqlite3.connect(f"file:{os.path.join(state, 'tinkerd.db')}?mode=ro", uri=True)
    try:
        futures = db.execute("select count(*) from futures").fetchone()[0]
        sessions = db.execute("select count(*) from sampling_sessions").fetchone()[0]
    finally:
        db.close()
    return {"step": step, "s": elapsed, "gateway": rss_mib(pids["gateway"]), "trainer": rss_mib(pids["trainer"]),
            "sampler": rss_mib(pids["sampler"]), "state_mib": disk_mib(state),
            "snapshots": len(os.listdir(snapshots)) if os.path.isdir(snapshots) else 0,
            "futures": futures, "sampling_sessions": sessions}


def _rows(series: list[dict], seconds: float) -> list[Row]:
    half = len(series) // 2
    first, second = series[:half] or series[:1], series[half:]
    span = (f"{series[-1]['step']} RL steps in {seconds:.0f} s ({seconds / PRUNE_EVERY_S:.0f} pruning rounds); "
            f"the most in the run's second half vs its first")
    tenths = [series[round(i * (len(series) - 1) / 9)] for i in range(10)] if len(series) > 10 else series
    cases = [("state dir", "state_mib", "MiB", ">= 0.8"), ("snapshot directories", "snapshots", "", ">= 0.8"),
             ("futures rows", "futures", "", ">= 0.8"), ("sampling-session rows", "sampling_sessions", "", ">= 0.8"),
             ("gateway RSS", "gateway", "MiB", ">= 0.7"), ("trainer RSS", "trainer", "MiB", ">= 0.7"),
             ("sampler RSS", "sampler", "MiB", ">= 0.7")]
    rows = []
    for what, key, unit, target in cases:
        late, early = max(p[key] for p in second), max(p[key] for p in first)
        trail = ", ".join(f"{p[key]:.0f}" for p in tenths)
        rows.append(Row("soak", f"tiny: {what}, peak of a long RL run's second half vs its first", late, early,
                        unit, ratio=early / late if late else 1.0, target=target,
                        note=f"{span}; every tenth: {trail}"))
    return rows
