"""tests/e2e/sdk_probe.py (every endpoint) against `tinkerd up`, driven by SDK 0.38.0 from the
project venv and by older releases, each in its own venv (made once under .venv-sdk-<version>/
from the package registry). A release that lacks a call skips it; which ones is pinned here."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# What each release cannot send (its SDK has no such method or loss name).
NOT_IN_SDK = {
    "0.38.0": set(),
    "0.30.4": {"forward_backward (gspo)", "forward_backward (stable_reinforce)",
               "sample with prompt_logprobs_last_n"},
    "0.25.0": {"forward_backward (gspo)", "forward_backward (stable_reinforce)",
               "sample with prompt_logprobs_last_n", "sample with top-k sample logprobs", "save_weights_external",
               "copy_weights", "close"},
}


def _sdk_python(version: str) -> str:
    if version == "0.38.0":
        return sys.executable
    venv = os.path.join(REPO, f".venv-sdk-{version}")
    python = os.path.join(venv, "bin", "python")
    probe = subprocess.run([python, "-c", "import tinker, torch; print(tinker.__version__)"], capture_output=True,
                           text=True) if os.path.exists(python) else None
    if probe is None or probe.stdout.strip() != version:
        subprocess.run([sys.executable, "-m", "venv", "--clear", venv], check=True)
        # torch for forward_backward_custom (client-side); the CPU build, not the registry's CUDA one.
        subprocess.run([python, "-m", "pip", "install", "-q", f"tinker=={version}", "torch==2.13.0"], check=True,
                       timeout=900)
    return python


@pytest.mark.parametrize("version", list(NOT_IN_SDK))
def test_every_endpoint(version, stack, tiny_model_dir):
    out = subprocess.run([_sdk_python(version), os.path.join(REPO, "tests", "e2e", "sdk_probe.py"), stack.url,
                          tiny_model_dir], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TINKER_API_KEY": stack.api_key, "TINKER_TELEMETRY": "0"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    assert f"ALL DONE {version}" in out.stdout, out.stdout
    skipped = {line[5:].split(":")[0] for line in out.stdout.splitlines() if line.startswith("SKIP ")}
    assert skipped == NOT_IN_SDK[version], out.stdout
