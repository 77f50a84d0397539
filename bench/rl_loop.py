"""The RL loop users run, end to end, with the CPU threads fixed against shared by who is busy.

tinker-cookbook 0.6.1's arithmetic RL recipe (`math_rl.train env=arithmetic`, unmodified: 16
prompts x 8 rollouts of up to 12 tokens, LoRA rank 32) against a fresh `tinkerd up` per run,
the runs taken in turn: TINKERD_CPU_THREADS=1 (one OpenMP thread per service, the old default)
and `auto` (tinkerd/cores.py: each busy service takes the host's cores divided by the busy
ones). The loop alternates sampling and training, so `auto` gives each phase every core.
Reported from the recipe's own metrics.jsonl: time/total, time/sampling, time/train_step per
step, and optim/kl_sample_train_v1 (the sampler's logprobs against the trainer's: ~0 in fp32).
The cookbook's venv is the one scripts/cookbook-venv.sh builds for the tests.

`--minutes M`: the learning run instead, `auto` only: the recipe at rank 16, lr 2e-4 for M minutes
of its wall time; its reward step by step, when it first reached 0.5, the mean of its last 10
steps, where a step's seconds go (sampling, training, the rest), and the gateway's CPU against
the wall time (our own work on the request path). `--off-policy 0,1`: one learning run per value
of the recipe's own `max_steps_off_policy` (0: on-policy; 1: the next batch sampled while this one
trains, off-policy by at most one step), in turn.

  python -m bench.rl_loop --steps 4 --rounds 1          (about 5 minutes on 2 cores, SmolLM2)
  python -m bench.rl_loop --minutes 15                  (the learning run)
  python -m bench.rl_loop --minutes 15 --off-policy 0,1 (on-policy, then off-policy by one step)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import tempfile
import time
from unittest import mock

from bench.common import cpu_seconds, smollm2_model
from harness.client_venvs import client_venv_root
from harness.stack import running_stack, service_pids
from tinkerd.cores import usable_cores

MODES = ("1", "auto")
RECIPE = ["renderer_name=role_colon", "env=arithmetic", "groups_per_batch=16", "group_size=8", "max_tokens=12",
          "lora_rank=32", "learning_rate=1e-4", "eval_every=0", "save_every=0", "behavior_if_log_dir_exists=delete"]
KEYS = ("time/total", "time/sampling", "time/train_step", "optim/kl_sample_train_v1")
LEARNING = {"lora_rank": "16", "learning_rate": "2e-4"}      # the learning run's (issue: fixed costs)
REWARD = "env/all/reward/total"


def default_cookbook_python() -> str:
    return os.path.join(client_venv_root(), "cookbook-0.6.1", "bin", "python")


def one_run(model_dir: str, threads: str, steps: int, cookbook_python: str, work: str) -> Run:
    """A fresh `tinkerd up` with TINKERD_CPU_THREADS=`threads`, the recipe for `steps` steps;
    the metrics of each step, and the CPU seconds each process spent over the whole run."""
    import psutil

    log_path = tempfile.mkdtemp(prefix=f"rl-{threads}-", dir=work)
    with mock.patch.dict(os.environ, TINKERD_CPU_THREADS=threads):      # the stack's services read it
        os.environ.pop("OMP_NUM_THREADS", None)
        with running_stack(model_dir, tempfile.mkdtemp(prefix="state-", dir=work)) as stack:
            services = {name: psutil.Process(pid) for name, pid in service_pids(stack.pid).items()}
            before = {name: cpu_seconds(p) for name, p in services.items()}
            children = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.monotonic()
            subprocess.run([cookbook_python, "-m", "tinker_cookbook.recipes.math_rl.train", f"model_name={model_dir}",
                            *RECIPE, f"max_steps={steps}", f"log_path={log_path}", f"base_url={stack.url}"],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=3600,
                           env={**os.environ, "TINKER_API_KEY": stack.api_key})
            wall = time.monotonic() - t0
            cpu = {name: cpu_seconds(p) - before[name] for name, p in services.items()}
            # The recipe's process, once waited for (the stack's services are not yet).
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu["client"] = after.ru_utime + after.ru_stime - children.ru_utime - children.ru_stime
    with open(os.path.join(log_path, "metrics.jsonl")) as f:
        return Run([m for m in map(json.loads, f) if "time/total" in m], cpu, wall)


@dataclasses.dataclass
class Run:
    steps: list[dict]               # the recipe's metrics, step by step
    cpu: dict[str, float]           # CPU seconds over the run: each service's, and the recipe's ("client")
    wall: float                     # seconds, the recipe's start to its end


def learning_run(model_dir: str, minutes: float, cookbook_python: str, work: str, off_policy: int = 0) -> str:
    """The recipe at LEARNING's settings, `auto` threads, stopped after `minutes` of its own wall
    time, on-policy or (`off_policy` > 0) sampling up to that many steps ahead of training; a
    report of its reward and of where its seconds went."""
    import psutil

    log_path = tempfile.mkdtemp(prefix="rl-learning-", dir=work)
    recipe = [a for a in RECIPE if a.split("=")[0] not in LEARNING] + [f"{k}={v}" for k, v in LEARNING.items()]
    if off_policy:
        recipe.append(f"max_steps_off_policy={off_policy}")
    os.environ.pop("OMP_NUM_THREADS", None)
    with running_stack(model_dir, tempfile.mkdtemp(prefix="state-", dir=work)) as stack:
        gateway = psutil.Process(service_pids(stack.pid)["gateway"])
        cpu0, t0 = cpu_seconds(gateway), time.monotonic()
        run = subprocess.Popen([cookbook_python, "-m", "tinker_cookbook.recipes.math_rl.train", f"model_name={model_dir}",
                                *recipe, "max_steps=100000", f"log_path={log_path}", f"base_url={stack.url}"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env={**os.environ, "TINKER_API_KEY": stack.api_key})
        elapsed = _step_times(run, os.path.join(log_path, "metrics.jsonl"), t0, t0 + 60 * minutes)
        wall, gateway_cpu = time.monotonic() - t0, cpu_seconds(gateway) - cpu0
    with open(os.path.join(log_path, "metrics.jsonl")) as f:
        steps = [m for m in map(json.loads, f) if REWARD in m and "time/total" in m]
    rewards = [m[REWARD] for m in steps]
    elapsed = elapsed[:len(steps)]
    first = next((t for t, r in zip(elapsed, rewards) if r >= 0.5), None)
    total, sampling, training = (sum(m.get(k, 0.0) for m in steps) for k in KEYS[:3])
    walls = [b - a for a, b in zip([0.0] + elapsed, elapsed)][2:] or [0.0]      # from the third step
    where = (f"of the recipe's time/total, sampling {sampling / total:.0%}, training {training / total:.0%}, "
             f"the rest {1 - (sampling + training) / total:.0%}" if not off_policy else
             "sampling overlaps training (the recipe's time/sampling is not kept)")
    return "\n".join([
        f"max_steps_off_policy={off_policy}: {len(steps)} steps in {wall:.0f} s ({minutes:g} minutes asked); "
        f"reward {rewards[0]:.2f} -> {rewards[-1]:.2f}; " +
        (f"first >= 0.5 after {first:.0f} s" if first is not None else "never >= 0.5"),
        f"mean reward of the last 10 steps: {statistics.mean(rewards[-10:]):.3f}",
        f"a step, from the third, wall: median {statistics.median(walls):.2f} s; {where}",
        f"the gateway's CPU: {gateway_cpu:.1f} s over {wall:.0f} s of wall time ({gateway_cpu / wall:.1%} of one core)",
        "seconds at each step: " + " ".join(f"{t:.0f}" for t in elapsed),
        "reward by step: " + " ".join(f"{r:.2f}" for r in rewards)])


def _step_times(run: subprocess.Popen, metrics_path: str, t0: float, deadline: float) -> list[float]:
    """Seconds from `t0` at which each step's metrics line appeared, read every 0.2 s until the
    run ends or the deadline (then it is stopped): the wall time of each step, on-policy or off
    (off-policy, the recipe's own time/total leaves out the wait for the next batch)."""
    seen: list[float] = []
    while run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
        lines = len(seen)
        with contextlib.suppress(FileNotFoundError), open(metrics_path) as f:
            lines = sum(1 for line in f if REWARD in line)
        seen += [time.monotonic() - t0] * (lines - len(seen))
    if run.poll() is None:
        run.terminate()
        run.wait(timeout=60)
    return seen


def render(runs: dict[str, list[Run]]) -> str:
    many = any(len(run.steps) > 8 for of_mode in runs.values() for run in of_mode)
    lines = ["| TINKERD_CPU_THREADS | run | step (s) | sampling (s) | train step (s) | max abs kl_sample_train |",
             "|---|---|---|---|---|---|"]
    for mode, of_mode in runs.items():
        for i, run in enumerate(of_mode):
            if many:        # medians from the third step
                cols = [f"{statistics.median(m[k] for m in run.steps[2:] or run.steps):.3f}" for k in KEYS[:3]]
            else:
                cols = [" / ".join(f"{m[k]:.1f}" for m in run.steps) for k in KEYS[:3]]
            kl = max(abs(m.get(KEYS[3], 0.0)) for m in run.steps)
            lines.append(f"| {mode} | {i + 1} | {' | '.join(cols)} | {kl:.1e} |")
    lines += ["", "CPU seconds a step, over the whole run (its wall time over its steps, first steps included):", "",
              "| TINKERD_CPU_THREADS | run | wall | recipe (SDK + cookbook) | gateway | sampler | trainer | "
              "gateway, of the host's CPU |", "|---|---|---|---|---|---|---|---|"]
    cores = usable_cores()
    for mode, of_mode in runs.items():
        for i, run in enumerate(of_mode):
            n = len(run.steps)
            per = {k: v / n for k, v in run.cpu.items()}
            share = run.cpu["gateway"] / (run.wall * cores)
            lines.append(f"| {mode} | {i + 1} | {run.wall / n:.3f} | {per['client']:.3f} | {per['gateway']:.3f} | "
                         f"{per['sampler']:.3f} | {per['trainer']:.3f} | {share:.1%} |")
    late = {mode: [m["time/total"] for run in of_mode for m in run.steps[2:]] for mode, of_mode in runs.items()}
    if all(late.values()):
        fixed, shared = (statistics.median(late[m]) for m in MODES)
        lines.append(f"\nFrom the third step, median step: {fixed:.1f} s fixed at 1 thread, {shared:.1f} s shared: "
                     f"{fixed / shared:.2f}x.")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.rl_loop", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=smollm2_model() or "", help="model directory (default: models/smollm2)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=1, help="runs of each mode, taken in turn")
    p.add_argument("--cookbook-python", default=default_cookbook_python())
    p.add_argument("--minutes", type=float, default=0.0, help="the learning run, this long (0: the threads runs)")
    p.add_argument("--off-policy", default="0", help="the learning runs' max_steps_off_policy values, in turn")
    args = p.parse_args(argv)
    if not args.model or not os.path.isfile(args.cookbook_python):
        p.error("needs --model (or `tinkerd fetch-smollm2 models/smollm2`) and the cookbook's venv "
                "(bash scripts/cookbook-venv.sh)")
    if args.minutes:
        with tempfile.TemporaryDirectory(prefix="rl-loop-") as work:
            for off_policy in map(int, args.off_policy.split(",")):
                print(learning_run(os.path.abspath(args.model), args.minutes, args.cookbook_python, work, off_policy),
                      flush=True)
        return
    runs: dict[str, list[Run]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="rl-loop-") as work:
        for _ in range(args.rounds):
            for mode in MODES:
                runs[mode].append(one_run(os.path.abspath(args.model), mode, args.steps, args.cookbook_python, work))
    print(render(runs))


if __name__ == "__main__":
    main()
