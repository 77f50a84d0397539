"""A change's effect on the stack's fixed cost per request, paired: this tree against an earlier
commit (a git worktree of it), their stacks run in turn, round after round, so the VM's drift
(up to 2x within minutes on the 2-core VMs) hits both alike.

Each round starts `tinkerd up` on the tiny model from one tree and loops each request kind
through the SDK for a few seconds: forward_backward (4 x 64), optim_step, a one-token sample,
and 16 such samples at once. Per request: the gateway's CPU, the SDK client's, and the wall time.
The verdict is the gateway's CPU over the SDK client's in the same round: the client does the
same work in both trees, so the quotient cancels the VM's speed of the moment. A change to what
the client does (its transport, its requests) voids that: read the medians then, wall time too.

    python -m bench.paired_costs --base 51a6108 [--rounds 3] [--seconds 8]

Each tree measures with its own code (`--measure`, run with that tree as the working directory
and first on the path), so a commit from before this file still runs: it needs only
bench/common.py and harness/stack.py, as they were then.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

KINDS = ("forward_backward", "optim_step", "sample", "sample, 16 at once")
BURST = 16


def measure(seconds: float, work_dir: str) -> dict:
    """In the tree that is the working directory: each kind's ms per request of the gateway's
    CPU ("gateway"), the SDK client's ("client") and wall time."""
    sys.path.insert(0, os.getcwd())
    import psutil
    import tinker
    from tinker import types

    from bench.common import Context, cpu_seconds, tiny_model, tinkerd_up
    from harness.stack import service_pids

    ctx = Context(quick=False, work_dir=work_dir, models={"tiny": tiny_model(work_dir)})
    with tinkerd_up(ctx, "paired", ctx.models["tiny"]) as stack:
        gateway, me = psutil.Process(service_pids(stack.pid)["gateway"]), psutil.Process()
        tc = tinker.ServiceClient(base_url=stack.url).create_lora_training_client(
            base_model=ctx.models["tiny"], rank=8).result()
        data = [types.Datum(model_input=types.ModelInput.from_ints(list(range(5, 69))),
                            loss_fn_inputs={"target_tokens": list(range(6, 70)), "weights": [1.0] * 64})
                for _ in range(4)]
        sampler = tc.save_weights_and_get_sampling_client().result()
        one, prompt = types.SamplingParams(max_tokens=1, temperature=0.0), types.ModelInput.from_ints([5, 6, 7])

        def burst():
            for f in [sampler.sample(prompt, 1, one) for _ in range(BURST)]:
                f.result()
        calls = {"forward_backward": (lambda: tc.forward_backward(data, "cross_entropy").result(), 1),
                 "optim_step": (lambda: tc.optim_step(types.AdamParams(learning_rate=1e-4)).result(), 1),
                 "sample": (lambda: sampler.sample(prompt, 1, one).result(), 1),
                 "sample, 16 at once": (burst, BURST)}
        out = {}
        for kind, (call, per_call) in calls.items():
            for _ in range(10):
                call()
            n, t0, g0, c0 = 0, time.perf_counter(), cpu_seconds(gateway), cpu_seconds(me)
            while time.perf_counter() - t0 < seconds:
                call()
                n += per_call
            out[kind] = {"gateway": 1e3 * (cpu_seconds(gateway) - g0) / n, "client": 1e3 * (cpu_seconds(me) - c0) / n,
                         "wall": 1e3 * (time.perf_counter() - t0) / n}
        return out


def _round(tree: str, seconds: float, work_dir: str) -> dict:
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TINKER_TELEMETRY": "0"}
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--measure", "--seconds", str(seconds),
                           "--work-dir", work_dir], cwd=tree, env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"the measurement in {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def compare(base: str, rounds: int, seconds: float) -> str:
    """The table of `base` against this tree, `rounds` rounds in turn (base first in odd rounds)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory(prefix="paired-") as tmp:
        base_tree = os.path.join(tmp, "base")
        subprocess.run(["git", "-C", repo, "worktree", "add", "--detach", base_tree, base], check=True,
                       capture_output=True)
        try:
            trees = {"base": base_tree, "this": repo}
            taken: dict[str, list[dict]] = {"base": [], "this": []}
            for r in range(rounds):
                for side in (("base", "this") if r % 2 == 0 else ("this", "base")):
                    taken[side].append(_round(trees[side], seconds, os.path.join(tmp, "work")))
        finally:
            subprocess.run(["git", "-C", repo, "worktree", "remove", "--force", base_tree], capture_output=True)
    rows = ["| request | gateway CPU, base / this (median ms) | SDK CPU, base / this | wall, base / this | "
            "this / base, gateway over SDK |", "|---|---|---|---|---|"]
    for kind in KINDS:
        def med(side, what):
            return statistics.median(m[kind][what] for m in taken[side])

        def quotient(side):
            return statistics.mean(m[kind]["gateway"] / m[kind]["client"] for m in taken[side])
        rows.append(f"| {kind} | {med('base', 'gateway'):.2f} / {med('this', 'gateway'):.2f} | "
                    f"{med('base', 'client'):.2f} / {med('this', 'client'):.2f} | "
                    f"{med('base', 'wall'):.2f} / {med('this', 'wall'):.2f} | "
                    f"×{quotient('this') / quotient('base'):.3f} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", help="the commit to compare this tree against")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0, help="each kind's loop, per round")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--work-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print("RESULT " + json.dumps(measure(args.seconds, args.work_dir)), flush=True)
        return
    if not args.base:
        parser.error("--base COMMIT is needed")
    print(compare(args.base, args.rounds, args.seconds))


if __name__ == "__main__":
    main()
