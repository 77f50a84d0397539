"""Older SDK releases, each in its own venv (made once under .venv-sdk-<version>/, from the
package registry), drive the core flow against the same `tinkerd up`."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VERSIONS = ["0.30.4", "0.25.0"]


def _sdk_python(version: str) -> str:
    venv = os.path.join(REPO, f".venv-sdk-{version}")
    python = os.path.join(venv, "bin", "python")
    probe = subprocess.run([python, "-c", "import tinker; print(tinker.__version__)"], capture_output=True, text=True) \
        if os.path.exists(python) else None
    if probe is None or probe.stdout.strip() != version:
        subprocess.run([sys.executable, "-m", "venv", "--clear", venv], check=True)
        subprocess.run([python, "-m", "pip", "install", "-q", f"tinker=={version}"], check=True, timeout=600)
    return python


@pytest.mark.parametrize("version", VERSIONS)
def test_older_sdk_core_flow(version, stack, tiny_model_dir):
    python = _sdk_python(version)
    out = subprocess.run([python, os.path.join(REPO, "tests", "e2e", "sdk_probe.py"), stack.url, tiny_model_dir],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TINKER_API_KEY": "tml-older-sdk", "TINKER_TELEMETRY": "0"})
    assert out.returncode == 0, out.stderr[-3000:]
    for step in ("create", "train", "sample", "save_state", "load"):
        assert f"OK {step}" in out.stdout, out.stdout
