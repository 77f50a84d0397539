"""Other releases of the tinker SDK, each in its own venv (made once under .venv-sdk-<version>/
from the package registry), for tests that drive the server with them."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def sdk_python(version: str, *, torch: bool = True) -> str:
    """The python of a venv with tinker==version (and, for client-side custom losses, the CPU
    torch rather than the registry's CUDA one); this process's python for the project's SDK."""
    import tinker

    if version == tinker.__version__:
        return sys.executable
    venv = os.path.join(REPO, f".venv-sdk-{version}")
    python = os.path.join(venv, "bin", "python")
    modules = "tinker, torch" if torch else "tinker"
    # Test workers run in parallel (pytest-xdist): one builds a venv while another waits for it.
    with open(f"{venv}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _ensure(venv, python, version, modules, torch)


def _ensure(venv: str, python: str, version: str, modules: str, torch: bool) -> str:
    probe = subprocess.run([python, "-c", f"import {modules}; print(tinker.__version__)"], capture_output=True,
                           text=True) if os.path.exists(python) else None
    if probe is None or probe.stdout.strip() != version:
        shutil.rmtree(venv, ignore_errors=True)
        packages = [f"tinker=={version}", *(["torch==2.13.0"] if torch else [])]
        subprocess.run(["bash", os.path.join(REPO, "scripts", "venv-install.sh"), venv, *packages], check=True,
                       timeout=900)
    return python
