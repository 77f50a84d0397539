"""Shared fixtures: a tiny model built locally, and a running `tinkerd up` on it."""

from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def running_stack(model_dir: str, state, *extra_args: str):
    """`tinkerd up` on `model_dir`; yields (base_url, state_dir, start_seconds), stops it after."""
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tinkerd.cli", "up", "--base-model", model_dir, "--port", "0",
         "--state-dir", str(state), *extra_args],
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
    try:
        yield url, str(state), time.monotonic() - t0
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="session")
def stack(tiny_model_dir, tmp_path_factory):
    """The shared `tinkerd up` on the tiny model, with default settings."""
    with running_stack(tiny_model_dir, tmp_path_factory.mktemp("state"), "--alias", "tiny/alias-model") as s:
        yield s


@pytest.fixture(scope="session")
def start_stack():
    """For tests that need a stack with other settings: `with start_stack(model, state, *flags)`."""
    return running_stack
