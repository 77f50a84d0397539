"""`python -m bench`: runs the benchmarks and writes bench/results/latest.md (and .json).

  python -m bench                 everything (about 10 minutes on a 2-core CPU)
  python -m bench --quick         a few iterations each, no verdicts (the test suite's smoke run)
  python -m bench --only tenants,batching

The full run gives each benchmark a process of its own, with its own stacks. The quick run, which
checks that every benchmark's code path still works and measures nothing worth keeping, runs them
all in this process, and every `tinkerd up` of the tiny model they ask for is one shared stack with
the flags of all (common.SharedStack; tenants' limits and soak's retentions change no other
benchmark's path): each process and stack start costs ~10-30 s on 2 cores, the smoke run's most.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time

from bench.common import REPO, Context, Row, SharedStack, check, new_dir, smollm2_model, tiny_model

BENCHMARKS = ["train_step", "trainer_ranks", "sdk_workload", "sampling", "sampler_replicas", "adapter_sampling",
              "weight_sync", "futures", "startup", "tenants", "batching", "soak", "bf16_gap", "request_costs", "dimuon",
              "rl_inflight"]
# Run first when they share a process: their in-process DeepSpeed engines set up the one-process gloo
# group, which vLLM's in-process engines join; DeepSpeed after a vLLM engine has gone finds its
# group unregistered.
DEEPSPEED_FIRST = ["train_step", "batching", "sdk_workload", "dimuon", "bf16_gap"]   # bf16_gap last: it ends with vLLM


def machine() -> str:
    from bench.trainer_only import machine as this_machine
    return this_machine()


def render(rows: list[Row], header: str, notes: list[str]) -> str:
    lines = [header, "", "| benchmark | case | tinkerd | raw engine | ratio | target | verdict | note |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        raw = f"{r.raw:.4g} {r.unit}" if r.raw is not None else ""
        ratio = f"{r.ratio:.3g}" if r.ratio is not None else ""
        verdict = "" if r.met is None else ("met" if r.met else "MISSED")
        lines.append(f"| {r.benchmark} | {r.case} | {r.ours:.4g} {r.unit} | {raw} | {ratio} | {r.target} | "
                     f"{verdict} | {r.note} |")
    return "\n".join(lines + [""] + notes) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", default=",".join(BENCHMARKS))
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results"))
    p.add_argument("--no-smollm2", action="store_true", help="tiny model only")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--rows-to", help=argparse.SUPPRESS)
    p.add_argument("--work-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if unknown := [n for n in args.only.split(",") if n not in BENCHMARKS]:
        p.error(f"no benchmark named {', '.join(unknown)}; there are {', '.join(BENCHMARKS)}")
    return args


def run_one(ctx: Context, name: str, rows_to: str) -> None:
    """In a child process: one benchmark, its rows written as JSON."""
    module = importlib.import_module(f"bench.{name}")
    rows = module.run(ctx)
    with open(rows_to, "w") as f:
        json.dump({"rows": [dataclasses.asdict(r) for r in rows], "notes": getattr(module, "NOTES", [])}, f)


@contextlib.contextmanager
def own_threads():
    """Threads as before, after a benchmark that set its own (train_step: every core for the raw
    engine and for the stacks it starts)."""
    import torch
    threads, omp = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        if omp is not None:
            os.environ["OMP_NUM_THREADS"] = omp


def run_here(ctx: Context, names: list[str]) -> tuple[list[Row], list[str]]:
    """The quick run: every benchmark in this process (DEEPSPEED_FIRST first), one shared stack;
    rows and notes in the order of `names`."""
    got: dict[str, tuple[list[Row], list[str]]] = {}
    flags = [f for n in names for f in getattr(importlib.import_module(f"bench.{n}"), "QUICK_STACK_FLAGS", ())]
    ctx.shared = SharedStack(ctx.models["tiny"], new_dir(ctx, "shared"), ctx.stack_flags(ctx.models["tiny"], tuple(flags)))
    try:
        for name in sorted(names, key=lambda n: DEEPSPEED_FIRST.index(n) if n in DEEPSPEED_FIRST else len(names)):
            t0 = time.monotonic()
            module = importlib.import_module(f"bench.{name}")
            with own_threads():
                got[name] = module.run(ctx), getattr(module, "NOTES", [])
            gc.collect()            # the raw engines of the benchmark that ended (vLLM's KV caches)
            print(f"[bench] {name}: {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    finally:
        ctx.shared.close()
    return [r for n in names for r in got[n][0]], [note for n in names for note in got[n][1]]


def run_all(ctx: Context, args: argparse.Namespace) -> tuple[list[Row], list[str], list[str]]:
    """Rows, notes, and the benchmarks that failed: a failure is reported, and the others still run
    (an hour's run is not lost to one of them)."""
    if ctx.quick:
        return *run_here(ctx, args.only.split(",")), []
    rows: list[Row] = []
    notes: list[str] = []
    failed: list[str] = []
    for name in args.only.split(","):
        # Each benchmark in its own process: raw vLLM and DeepSpeed each own torch.distributed state.
        t0 = time.monotonic()
        out = os.path.join(ctx.work_dir, f"{name}.rows.json")
        cmd = [sys.executable, "-m", "bench", "--one", name, "--rows-to", out, "--work-dir", ctx.work_dir,
               *(["--quick"] if args.quick else []), *(["--no-smollm2"] if args.no_smollm2 else [])]
        if subprocess.run(cmd, cwd=REPO).returncode != 0:
            print(f"[bench] {name} failed", file=sys.stderr)
            failed.append(name)
            continue
        with open(out) as f:
            got = json.load(f)
        for r in (Row(**d) for d in got["rows"]):
            if r.target and not ctx.quick:   # a ratio's target, else the value's own
                r.met = check(r.ratio if r.ratio is not None else r.ours, r.target)
            rows.append(r)
        notes += got["notes"]
        print(f"[bench] {name}: {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    return rows, notes, failed


def write_results(ctx: Context, out_dir: str, rows: list[Row], notes: list[str], seconds: float,
                  failed: tuple[str, ...] | list[str] = ()) -> None:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    host = machine()
    header = (f"## Benchmarks — {stamp}{' (quick smoke run: no verdicts)' if ctx.quick else ''}\n\n"
              f"Machine: {host}. Models: {', '.join(ctx.models)}. Total {seconds:.0f} s."
              + (f" **Failed (no rows; see the run's output): {', '.join(failed)}.**" if failed else ""))
    if notes:
        notes = ["### Why the misses (profiled)", ""] + [f"- {n}" for n in notes]
    table = render(rows, header, notes)
    print(table)
    os.makedirs(out_dir, exist_ok=True)
    stem = "quick" if ctx.quick else "latest"
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
        f.write(table)
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump({"date": stamp, "machine": host, "rows": [dataclasses.asdict(r) for r in rows],
                   "failed": list(failed)}, f, indent=1)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TINKER_API_KEY", "tml-bench")
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = args.work_dir or tempfile.mkdtemp(prefix="tinkerd-bench-")
    models = {"tiny": tiny_model(work)}
    if not args.no_smollm2 and (path := smollm2_model()):
        models["smollm2"] = path
    ctx = Context(quick=args.quick, work_dir=work, models=models)
    if args.one:
        run_one(ctx, args.one, args.rows_to)
        return 0
    t0 = time.monotonic()
    rows, notes, failed = run_all(ctx, args)
    write_results(ctx, args.out, rows, notes, time.monotonic() - t0, failed)
    return 1 if failed else 0


if __name__ == "__main__":
    # The allocator tinkerd's trainer and sampler run (tinkerd/process.py), so that the in-process
    # rows (plain PyTorch, raw DeepSpeed, raw vLLM) are measured under it too, not under glibc.
    from tinkerd.process import reexec_with_tcmalloc
    reexec_with_tcmalloc()
    sys.exit(main())
