"""The trainer's RL step under glibc malloc and under tcmalloc, each in processes of its own, in turn.

Why: a training step on CPU allocates and frees the same large tensors every step (the logits and
their gradients: [tokens, vocabulary] fp32, ~80 MB a micro-batch on SmolLM2). glibc serves blocks
that large with mmap and returns them with munmap, so every step faults every page in again (the
kernel zeroes each one): on the RL batch below ~0.9M minor faults and 3-10 s of system time per
step. tcmalloc keeps freed spans for reuse. `tinkerd trainer` re-executes itself with tcmalloc
preloaded, as the sampler does (tinkerd/process.py); this measures what that is worth.

The workload is the cookbook's arithmetic RL batch (bench/rl_loop.py): 16 prompts of 34 tokens x 8
rollouts of 12, fp32, LoRA rank 32, on a random-init model of SmolLM2's shape (bench/trainer_only),
packed as token trees, one TrainerEngine step (forward_backward + optim_step) at a time. A child
process per allocator and round, alternating, `--steps` steps each after one warm-up; the medians
over all rounds. Only the preload differs between them (LD_PRELOAD set or removed).

  python -m bench.allocator                    (about 8 minutes on 2 cores)
  python -m bench.allocator --shape tiny --steps 2 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ALLOCATORS = ("glibc malloc", "tcmalloc")
RL_BATCH = dict(batch=128, length=46, group=8, prompt=34, rank=32)


def child(shape: str, dtype: str, steps: int) -> dict:
    """Runs in the measured process: `steps` timed engine steps after one warm-up; per step the
    seconds, system CPU seconds and minor page faults."""
    import bench.trainer_only as t
    from tinkerd.process import allocator

    setup = t.Setup(device="cpu", shape=shape, dtype=dtype, **RL_BATCH)
    with tempfile.TemporaryDirectory(prefix="allocator-") as work:
        base = t.build_model(setup, work)
        sequences = t.random_batch(setup, base.config.vocab_size)
        del base
        step = t.engine_step(t.new_engine(work, setup, ["a"]), ["a"], sequences, setup)
        step()
        taken = []
        for _ in range(steps):
            before, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            step()
            seconds, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
            taken.append({"s": seconds, "sys_s": after.ru_stime - before.ru_stime,
                          "faults": after.ru_minflt - before.ru_minflt})
    return {"allocator": allocator(), "steps": taken}


def run_child(name: str, shape: str, dtype: str, steps: int) -> dict:
    from tinkerd.process import tcmalloc_preload

    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if name == "tcmalloc":
        preload = tcmalloc_preload({})
        if preload is None:
            raise SystemExit("bench.allocator: libtcmalloc-minimal4 is not installed (scripts/setup.sh installs it)")
        env["LD_PRELOAD"] = preload
    env.setdefault("OMP_NUM_THREADS", str(os.cpu_count()))
    out = subprocess.run([sys.executable, "-m", "bench.allocator", "--child", "--shape", shape, "--dtype", dtype,
                          "--steps", str(steps)], env=env, check=True, capture_output=True, text=True, timeout=3600)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if result["allocator"] != name:
        raise SystemExit(f"bench.allocator: the child ran {result['allocator']}, not {name}")
    return result


def render(results: dict[str, list[dict]], shape: str, dtype: str) -> str:
    b = RL_BATCH
    lines = [f"allocator: the engine's RL step, {shape} {dtype}, {b['batch'] // b['group']} prompts of {b['prompt']} "
             f"tokens x {b['group']} rollouts of {b['length'] - b['prompt']}, rank {b['rank']}; medians over "
             f"{sum(len(r['steps']) for r in next(iter(results.values())))} steps per allocator, in turn",
             "", "| allocator | step (s) | system CPU (s/step) | minor faults/step |", "|---|---|---|---|"]
    medians = {}
    for name, runs in results.items():
        steps = [s for r in runs for s in r["steps"]]
        medians[name] = statistics.median(s["s"] for s in steps)
        lines.append(f"| {name} | {medians[name]:.2f} | {statistics.median(s['sys_s'] for s in steps):.2f} | "
                     f"{statistics.median(s['faults'] for s in steps):,.0f} |")
    lines.append(f"\nglibc / tcmalloc step: {medians['glibc malloc'] / medians['tcmalloc']:.2f}x")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.allocator", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2", help="bench/trainer_only.py's shapes (default: smollm2)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--steps", type=int, default=3, help="timed steps per process, after one warm-up")
    p.add_argument("--rounds", type=int, default=2, help="processes per allocator, taken in turn")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.shape, a.dtype, a.steps)), flush=True)
        return
    results: dict[str, list[dict]] = {name: [] for name in ALLOCATORS}
    for _ in range(a.rounds):
        for name in ALLOCATORS:
            results[name].append(run_child(name, a.shape, a.dtype, a.steps))
    print(render(results, a.shape, a.dtype))


if __name__ == "__main__":
    main()
