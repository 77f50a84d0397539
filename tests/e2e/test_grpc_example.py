"""examples/grpc_client.py against `tinkerd trainer` + `tinkerd sampler` started as separate
processes, with no gateway: the gRPC API as other services use it. In the same run (the two
processes are the expensive part): grpc.health.v1 on both, and their --metrics-port."""

from __future__ import annotations

import json
import os
import pathlib
import secrets
import signal
import subprocess
import sys
import urllib.request

import pytest

from conftest import TINY_KV_CACHE
from tinkerd import health
from tinkerd.rpc import ServiceAuth

pytestmark = pytest.mark.e2e

REPO = pathlib.Path(__file__).resolve().parents[2]


def _start(name: str, model_dir: str, state: pathlib.Path, token_file: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "launcher.cli", name, "--base-model", model_dir, "--state-dir", str(state),
         "--service-token-file", token_file, "--metrics-port", "0",
         *(("--dtype", "float32") if name != "gateway" else ()),      # exact trainer = sampler (conftest.py)
         *(TINY_KV_CACHE if name == "sampler" else ())],
        stdout=subprocess.PIPE, stderr=open(state / f"{name}.log", "ab"), text=True, start_new_session=True)


def _ports(proc: subprocess.Popen, name: str, state: pathlib.Path) -> dict[str, int]:
    """{"READY": grpc port, "METRICS": metrics port} from the service's stdout."""
    ports = {}
    for line in proc.stdout:
        parts = line.split()
        if len(parts) == 3 and parts[0] in ("READY", "METRICS") and parts[1] == name:
            ports[parts[0]] = int(parts[2])
            if parts[0] == "READY":
                return ports
    raise RuntimeError(f"{name} exited with {proc.wait()}: {(state / f'{name}.log').read_text()[-3000:]}")


def test_example_trains_pushes_and_samples_over_plain_grpc(tiny_model_dir, tmp_path):
    token_file = tmp_path / "service-token"
    token_file.write_text(secrets.token_urlsafe(32))
    procs = {name: _start(name, tiny_model_dir, tmp_path, str(token_file)) for name in ("trainer", "sampler")}
    try:
        ports = {name: _ports(proc, name, tmp_path) for name, proc in procs.items()}
        grpc_address = {name: f"127.0.0.1:{p['READY']}" for name, p in ports.items()}
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        out = subprocess.run([sys.executable, str(REPO / "examples" / "grpc_client.py"),
                              "--trainer", grpc_address["trainer"], "--sampler", grpc_address["sampler"],
                              "--base-model", tiny_model_dir, "--service-token-file", str(token_file)],
                             capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
        assert out.returncode == 0, out.stdout + out.stderr
        summary = json.loads(out.stdout.strip().splitlines()[-1])
        assert summary["health"] == {"trainer": "SERVING", "sampler": "SERVING"}
        losses = summary["losses"]
        assert len(losses) == 4 and min(losses[1:]) < losses[0] and losses[-1] < losses[0], losses
        assert summary["pushed_bytes"] > 0
        assert len(summary["samples"]) == 2 and all(len(s) == 8 for s in summary["samples"])
        assert summary["trainer_vs_snapshot"] < 1e-3        # the sampler serves the trained adapter
        assert summary["base_vs_snapshot"] > 1e-2

        # grpc.health.v1: the overall status and each named service, Check without the token.
        for name, service in (("trainer", "tinkerd.v1.Trainer"), ("sampler", "tinkerd.v1.Sampler")):
            assert health.check(grpc_address[name]) == "SERVING"
            assert health.check(grpc_address[name], service, ServiceAuth()) == "SERVING"

        # Both services' /metrics saw the example's work.
        for name, counter in (("trainer", 'tinkerd_trainer_weight_pushes_total 1.0'),
                              ("sampler", 'tinkerd_sampler_snapshot_loads_total{source="stream"} 1.0')):
            with urllib.request.urlopen(f"http://127.0.0.1:{ports[name]['METRICS']}/metrics", timeout=10) as r:
                text = r.read().decode()
            assert counter in text, (name, counter)
            assert 'tinkerd_rpc_duration_seconds_count{code="OK",method="' in text
    finally:
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
