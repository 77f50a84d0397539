"""Other releases of the tinker SDK, each in its own client venv made once from the package
registry, for tests that drive the server with them.

Client venvs hold no code of this repo, so they live outside the clone, keyed by what they hold
(`client_venv_root()`): a fresh clone (CI makes one per run) reuses them instead of building four
venvs with torch again."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def client_venv_root() -> str:
    """Where client venvs live: $TINKERD_CLIENT_VENVS, else ~/.cache/tinkerd/client-venvs
    (scripts/cookbook-venv.sh uses the same place)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("TINKERD_CLIENT_VENVS") or os.path.join(cache, "tinkerd", "client-venvs")


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
