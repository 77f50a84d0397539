"""Training tokens/s of the trainer as one job of W=2 ranks vs W=1 (trainer_service/ranks.py).

Each case is a torchrun job driving TrainerEngine from rank 0 (the other ranks follow its
commands, as under `tinkerd trainer`): forward_backward of a batch (split across the ranks) +
optim_step, median of the steps after a warm-up. "ours" is W=2, "raw" W=1 on the same machine;
the ratio is W=2's tokens/s over W=1's. No target: on a 2-core CPU both ranks share the cores
with everything else, so the gain is small; it is reported as measured.

    python -m torch.distributed.run --standalone --nproc-per-node W -m bench.trainer_ranks MODEL STEPS OUT
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import time

from bench.common import REPO, Context, Row, new_dir

RANK = 16
BATCH, LENGTH = 8, 64
ZERO_STAGE = 2


def job(model_dir: str, steps: int, out: str) -> None:
    """One W-rank job (run under torchrun): rank 0 times the steps and writes them to `out`."""
    import torch

    from trainer_service.engine import AdamParams, DatumInput, TrainerEngine
    from trainer_service.lora import LoraSpec

    engine = TrainerEngine(model_dir, zero_stage=ZERO_STAGE)
    if not engine.ranks.leader:
        engine.ranks.follow(engine)
        return
    gen = torch.Generator().manual_seed(0)
    data = []
    for _ in range(BATCH):
        tokens = torch.randint(0, min(engine.vocab_size, 1000), (LENGTH + 1,), generator=gen)
        data.append(DatumInput(tokens[:-1].tolist(), {"target_tokens": tokens[1:]}))
    adam = AdamParams(learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, grad_clip_norm=0.0)
    engine.create_model("bench", LoraSpec(rank=RANK, seed=0))
    times = []
    for _ in range(steps + 2):
        t0 = time.perf_counter()
        engine.forward_backward("bench", data, "cross_entropy", {}, forward_only=False)
        engine.optim_step("bench", adam)
        times.append(time.perf_counter() - t0)
    engine.ranks.stop()
    with open(out, "w") as f:
        json.dump({"world": engine.ranks.world, "seconds": times[2:]}, f)


def _run(world: int, model_dir: str, steps: int, work: str) -> float:
    """Median step seconds of a W-rank job."""
    out = os.path.join(work, f"w{world}.json")
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                                                            "LOCAL_RANK")}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                    "-m", "bench.trainer_ranks", model_dir, str(steps), out],
                   env={**env, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}, cwd=REPO, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(out) as f:
        return statistics.median(json.load(f)["seconds"])


def run(ctx: Context) -> list[Row]:
    rows = []
    for name, model in ctx.models.items():
        work = new_dir(ctx, f"ranks-{name}")
        steps = ctx.iters(10 if name == "tiny" else 5)
        if ctx.quick:   # the smoke run: both jobs at once (a job is mostly its ranks' imports, ~20 s)
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                one, two = pool.map(lambda world: _run(world, model, steps, work), (1, 2))
        else:
            one, two = _run(1, model, steps, work), _run(2, model, steps, work)
        tokens = BATCH * LENGTH
        rows.append(Row("trainer_ranks", f"{name}: W=2 vs W=1 ranks, fwd_bwd+optim {BATCH}x{LENGTH} tokens, "
                                         f"rank {RANK}, ZeRO-{ZERO_STAGE}",
                        tokens / two, tokens / one, "tok/s", ratio=one / two,
                        note=f"step {1e3 * two:.0f} ms on 2 ranks, {1e3 * one:.0f} ms on 1; {os.cpu_count()} CPUs"))
    return rows


if __name__ == "__main__":
    from tinkerd.process import exit_now

    job(sys.argv[1], int(sys.argv[2]), sys.argv[3])
    exit_now()          # as `tinkerd trainer` ends (trainer_service/ranks.py: _leave_job)
