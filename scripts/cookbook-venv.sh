#!/usr/bin/env bash
# Creates the cookbook's client venv (or $VENV): a client-only venv with tinker 0.38.0 and tinker-cookbook 0.6.1
# (and pytest, for the cookbook's own smoke tests), used by tests/e2e/test_cookbook.py. The cookbook
# pins tml-renderers>=0.4.1, which the registry lacks (only the Inkling/Kimi-K3.1 renderers import
# it), so it goes in with --no-deps and its other dependencies are listed here. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
# Outside the clone, keyed by version (harness/client_venvs.py): fresh clones reuse it.
ROOT="${TINKERD_CLIENT_VENVS:-${XDG_CACHE_HOME:-$HOME/.cache}/tinkerd/client-venvs}"
VENV="${VENV:-$ROOT/cookbook-0.6.1}"
mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"; flock 9       # another clone's run may be building it
PY="$VENV/bin/python"
if "$PY" -c "import tinker_cookbook, tinker, math_verify, pytest" 2>/dev/null; then exit 0; fi
rm -rf "$VENV"
# The CPU build of torch is named, so nothing resolves to a CUDA wheel on a CPU host.
bash scripts/venv-install.sh "$VENV" torch==2.13.0 tinker==0.38.0 aiohttp anyio blobfile chz cloudpickle "datasets>=2.14" \
  "huggingface-hub>=0.20" numpy pillow pydantic pyrage rich safetensors termcolor "tiktoken>=0.12" tqdm \
  "transformers>=4.57.6,!=5.3.0,!=5.4.*,!=5.5.0,!=5.5.1,!=5.5.2,!=5.5.3,!=5.6.*" \
  "math-verify>=0.5.0" "pylatexenc>=2.0" "sympy>=1.12.0" pytest
bash scripts/venv-install.sh "$VENV" --no-deps tinker-cookbook==0.6.1
"$PY" -c "import tinker_cookbook.recipes.sl_loop, tinker_cookbook.recipes.math_rl.train; print('cookbook venv ready')"
