"""Shared fixtures: a tiny model built locally, and a running `tinkerd up` on it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_API_KEY", "tml-local-tests")
os.environ.setdefault("TINKER_TELEMETRY", "0")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from tinkerd.models import build_tiny_model
    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama"))


@pytest.fixture(scope="session")
def stack(tiny_model_dir, tmp_path_factory):
    """`tinkerd up` on the tiny model; yields (base_url, state_dir, start_seconds)."""
    state = tmp_path_factory.mktemp("state")
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tinkerd.cli", "up", "--base-model", tiny_model_dir, "--port", "0",
         "--state-dir", str(state), "--alias", "tiny/alias-model"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        m = re.match(r"TINKER_BASE_URL=(\S+)", line)
        if m:
            url = m.group(1)
            break
    if url is None:
        proc.wait(timeout=30)
        logs = "".join(open(os.path.join(state, "logs", f)).read()[-3000:] for f in os.listdir(state / "logs"))
        raise RuntimeError("tinkerd up failed:\n" + "".join(lines) + logs)
    start_seconds = time.monotonic() - t0
    yield url, str(state), start_seconds
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
