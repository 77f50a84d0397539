"""A change's effect on the stack's fixed cost per request, paired: this tree against an earlier
commit (a git worktree of it), their loops run in turn, round after round, so the VM's drift
(up to 2x within minutes on the 2-core VMs) hits both alike.

Each tree's `tinkerd up` on the tiny model starts once and stays up for every round (the other
tree's idles meanwhile, ~3% of a core, its trainer writing nothing for being idle); in each round
each tree loops each request kind through the SDK for a few seconds: forward_backward (4 x 64),
optim_step, a one-token sample, 16 such samples at once, and a named save_weights_for_sampler. Per
request: the gateway's CPU, the SDK client's, and the wall time.

Read per round: this tree over the base in the same round, its median and range over the rounds.
The gateway's CPU over the SDK client's cancels the VM's speed of the moment, since the client
does the same work in both trees; a change to what the client does (its transport, its requests)
voids that quotient: read the wall time then.

    python -m bench.paired_costs --base 51a6108 [--rounds 6] [--seconds 4] [--kinds sample,burst]

Each tree measures with its own code: this file runs with that tree as the working directory and
first on the path (`--serve`), so a commit from before this file still runs: it needs only
bench/common.py and harness/stack.py, as they were then.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

KINDS = {"fb": "forward_backward", "optim": "optim_step", "sample": "sample", "burst": "sample, 16 at once",
         "save": "save_weights_for_sampler (named)"}
BURST = 16
SETTLE_S = 0.5        # after a loop, before the other tree's: the SDK's last acknowledgements answered


def serve(work_dir: str) -> None:
    """In the tree that is the working directory: starts its stack, then for each line "KIND
    SECONDS" on stdin loops that kind and prints "RESULT " and the ms per request of the gateway's
    CPU ("gateway"), the SDK client's ("client") and wall time, as JSON."""
    sys.path.insert(0, os.getcwd())
    import psutil
    import tinker
    from tinker import types

    from bench.common import Context, cpu_seconds, tiny_model, tinkerd_up
    from harness.stack import service_pids

    ctx = Context(quick=False, work_dir=work_dir, models={"tiny": tiny_model(work_dir)})
    # No durable write for being idle: a trainer idles while the other tree measures.
    with tinkerd_up(ctx, "paired", ctx.models["tiny"], "--durable-idle-s", "0") as stack:
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
        calls = {"fb": (lambda: tc.forward_backward(data, "cross_entropy").result(), 1),
                 "optim": (lambda: tc.optim_step(types.AdamParams(learning_rate=1e-4)).result(), 1),
                 "sample": (lambda: sampler.sample(prompt, 1, one).result(), 1),
                 "burst": (burst, BURST),
                 "save": (lambda: tc.save_weights_for_sampler(f"c{time.monotonic_ns()}").result(), 1)}
        for call, _ in calls.values():
            for _ in range(10):
                call()
        print("READY", flush=True)
        for line in sys.stdin:
            kind, seconds = line.split()
            call, per_call = calls[kind]
            n, t0, g0, c0 = 0, time.perf_counter(), cpu_seconds(gateway), cpu_seconds(me)
            while time.perf_counter() - t0 < float(seconds):
                call()
                n += per_call
            result = {"gateway": 1e3 * (cpu_seconds(gateway) - g0) / n, "client": 1e3 * (cpu_seconds(me) - c0) / n,
                      "wall": 1e3 * (time.perf_counter() - t0) / n}
            time.sleep(SETTLE_S)
            print("RESULT " + json.dumps(result), flush=True)


class _Side:
    """One tree's serving process."""

    def __init__(self, tree: str, work_dir: str):
        env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
               "TINKER_TELEMETRY": "0"}
        self.tree = tree
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", "--work-dir", work_dir],
                                     cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._read("READY")

    def _read(self, prefix: str) -> str:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the measuring process in {self.tree} exited ({self.proc.wait()})")
            if line.startswith(prefix):
                return line[len(prefix):]

    def measure(self, kind: str, seconds: float) -> dict:
        self.proc.stdin.write(f"{kind} {seconds}\n")
        self.proc.stdin.flush()
        return json.loads(self._read("RESULT "))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(60)          # its stack stops as the loop on stdin ends
        except subprocess.TimeoutExpired:
            self.proc.kill()


def compare(base: str, rounds: int, seconds: float, kinds: list[str]) -> str:
    """The table of `base` against this tree over `rounds` rounds (base first in even rounds)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    taken: dict[tuple[str, str], list[dict]] = {(side, k): [] for side in ("base", "this") for k in kinds}
    with tempfile.TemporaryDirectory(prefix="paired-") as tmp:
        base_tree = os.path.join(tmp, "base")
        subprocess.run(["git", "-C", repo, "worktree", "add", "--detach", base_tree, base], check=True,
                       capture_output=True)
        sides: dict[str, _Side] = {}
        try:
            for side, tree in (("base", base_tree), ("this", repo)):
                sides[side] = _Side(tree, os.path.join(tmp, f"work-{side}"))
            for r in range(rounds):
                for kind in kinds:
                    for side in (("base", "this") if r % 2 == 0 else ("this", "base")):
                        taken[side, kind].append(sides[side].measure(kind, seconds))
        finally:
            for s in sides.values():
                s.close()
            subprocess.run(["git", "-C", repo, "worktree", "remove", "--force", base_tree], capture_output=True)
    rows = ["| request | gateway CPU, base / this (median ms) | SDK CPU, base / this | wall, base / this | "
            "this / base per round: wall | gateway over SDK |", "|---|---|---|---|---|---|"]
    for kind in kinds:
        base_m, this_m = taken["base", kind], taken["this", kind]

        def med(ms, what):
            return statistics.median(m[what] for m in ms)

        def per_round(value) -> str:
            ratios = [value(t) / value(b) for b, t in zip(base_m, this_m)]
            return f"×{statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f})"
        rows.append(f"| {KINDS[kind]} | {med(base_m, 'gateway'):.2f} / {med(this_m, 'gateway'):.2f} | "
                    f"{med(base_m, 'client'):.2f} / {med(this_m, 'client'):.2f} | "
                    f"{med(base_m, 'wall'):.2f} / {med(this_m, 'wall'):.2f} | {per_round(lambda m: m['wall'])} | "
                    f"{per_round(lambda m: m['gateway'] / m['client'])} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", help="the commit to compare this tree against")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=4.0, help="each kind's loop, per round")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"of {', '.join(KINDS)}")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--work-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.work_dir)
        return
    if not args.base:
        parser.error("--base COMMIT is needed")
    kinds = args.kinds.split(",")
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        parser.error(f"--kinds: {', '.join(unknown)} unknown; of {', '.join(KINDS)}")
    print(compare(args.base, args.rounds, args.seconds, kinds))


if __name__ == "__main__":
    main()
