"""Where client venvs live (the SDK's other releases, the cookbook): outside the clone, keyed by
what they hold, so a fresh clone (CI makes one per run) reuses them. Tests (tests/e2e/sdk_venvs.py)
and benchmarks (bench/rl_loop.py) find them here; scripts/cookbook-venv.sh builds in the same place."""

from __future__ import annotations

import os


def client_venv_root() -> str:
    """$TINKERD_CLIENT_VENVS, else $XDG_CACHE_HOME (~/.cache)/tinkerd/client-venvs."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("TINKERD_CLIENT_VENVS") or os.path.join(cache, "tinkerd", "client-venvs")
