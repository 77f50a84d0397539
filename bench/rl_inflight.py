"""An RL loop on-policy against off-policy by one step with an inflight sampling client: what
overlapping sampling with training buys, through the unmodified SDK against `tinkerd up`.

The loop is examples/rl_inflight.py (the cookbook's arithmetic task, groups of rollouts, the
importance_sampling loss), run here as it is: on-policy (snapshot, sample, train, in turn) and
inflight (the next batch sampled while this one trains), each from a fresh LoRA client of the
same seed, the two taken in turn on one stack. The figure is on-policy's seconds per step over
inflight's (the median step but the first, on-policy in both, and inflight's last); the note
has each mode's reward per step and its kl_sample_train (the sampler's logprob less the trainer's:
on-policy the dtype's noise, ~0 in fp32; inflight that plus one step of policy drift).
The stacks run the dtype `tinkerd up` picks (auto).

Trainer and sampler share the host's cores, so the run is repeated per thread policy of the
stack (TINKERD_CPU_THREADS): `auto` gives a busy service every core, and the phases of the
on-policy loop each already use them all; `1` keeps each service on one thread, where on-policy
leaves a core idle in each phase and overlap can fill it. The quick run uses the shared stack as
it is (its thread policy), for two short steps of each mode.

  python -m bench --only rl_inflight          (tiny model; SmolLM2 too when models/smollm2 exists)
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import statistics
import sys
from unittest import mock

from bench.common import REPO, Context, Row, tinkerd_up

THREADS = ("auto", "1")
FULL = {"tiny": dict(steps=8, groups=8, group_size=8, max_tokens=12, rank=32, learning_rate=1e-4),
        "smollm2": dict(steps=6, groups=8, group_size=8, max_tokens=12, rank=32, learning_rate=1e-4)}
QUICK = dict(steps=2, groups=2, group_size=2, max_tokens=4, rank=8)
ROUNDS = {"tiny": 2, "smollm2": 1}          # runs of each mode, in turn (a SmolLM2 step is seconds)


def example():
    """examples/rl_inflight.py as a module (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location("rl_inflight_example", os.path.join(REPO, "examples", "rl_inflight.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module             # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def stack_with_threads(ctx: Context, name: str, model_dir: str, threads: str | None):
    """`tinkerd up` on `model_dir` with TINKERD_CPU_THREADS=`threads` (None: as this process has it)."""
    if threads is None:
        with tinkerd_up(ctx, name, model_dir) as stack:
            yield stack
        return
    with mock.patch.dict(os.environ, TINKERD_CPU_THREADS=threads):      # the stack's services read it
        with tinkerd_up(ctx, name, model_dir) as stack:
            yield stack


def steady(steps: list) -> list:
    """The steps but the first (on-policy in both modes, and the adapter's first load) and the last
    (inflight samples nothing during it)."""
    return steps[1:-1] or steps[1:]


def per_step(runs: list, field: str = "seconds") -> float:
    return statistics.median(getattr(s, field) for steps in runs for s in steady(steps))


def curve(runs: list, field: str, fmt: str) -> str:
    """Each step's `field`, averaged over the runs."""
    return " ".join(format(statistics.fmean(getattr(steps[i], field) for steps in runs), fmt)
                    for i in range(len(runs[0])))


def measure(ctx: Context, name: str, model_dir: str, threads: str | None) -> Row:
    ex = example()
    cfg = ex.Config(**(QUICK if ctx.quick else FULL[name]))
    runs: dict[str, list] = {mode: [] for mode in ex.MODES}
    with stack_with_threads(ctx, f"rl_inflight-{name}", model_dir, threads) as stack:
        for r in range(1 if ctx.quick else ROUNDS[name]):
            for mode in ex.MODES if r % 2 == 0 else reversed(ex.MODES):
                runs[mode].append(ex.run(stack.url, model_dir, mode, cfg, verbose=False))
    on, off = per_step(runs["on-policy"]), per_step(runs["inflight"])
    waits = {mode: per_step(rs, "sample_wait") for mode, rs in runs.items()}
    note = "; ".join(f"{mode}: reward per step {curve(rs, 'reward', '.2f')}, kl_sample_train "
                     f"{curve(rs, 'kl_sample_train', '.1e')}, waiting for samples {waits[mode]:.2f} s"
                     for mode, rs in runs.items())
    label = threads if threads is not None else os.environ.get("TINKERD_CPU_THREADS", "default")
    case = (f"{name} TINKERD_CPU_THREADS={label}: {cfg.groups}x{cfg.group_size} rollouts of {cfg.max_tokens} tokens, "
            f"r{cfg.rank}, s/step (ours inflight, raw on-policy)")
    return Row("rl_inflight", case, off, on, "s", ratio=on / off, note=f"{len(runs['inflight'])} runs of "
               f"{cfg.steps} steps each mode; {note}")


def run(ctx: Context) -> list[Row]:
    if ctx.quick:
        return [measure(ctx, "tiny", ctx.models["tiny"], None)]
    return [measure(ctx, name, model, threads) for name, model in ctx.models.items() for threads in THREADS]
