"""Other releases of the tinker SDK, each in its own client venv made once from the package
registry, for tests that drive the server with them.

Client venvs hold no code of this repo, so they live outside the clone, keyed by what they hold
(harness/client_venvs.py): a fresh clone (CI makes one per run) reuses them instead of building
four venvs with torch again."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys

from harness.client_venvs import client_venv_root

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def sdk_python(version: str, *, torch: bool = True) -> str:
    """The python of a venv with tinker==version (and, for client-side custom losses, the CPU
    torch rather than the registry's CUDA one); this process's python for the project's SDK."""
    import tinker

    if version == tinker.__version__:
        return sys.executable
    venv = os.path.join(client_venv_root(), f"sdk-{version}")
    os.makedirs(os.path.dirname(venv), exist_ok=True)
    python = os.path.join(venv, "bin", "python")
    modules = "tinker, torch" if torch else "tinker"
    # Test workers (pytest-xdist) and other clones run at once: one builds a venv while others wait.
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
