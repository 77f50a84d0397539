#!/usr/bin/env bash
# Sets up and runs every test (unit + e2e against a real `tinkerd up` on a tiny model).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TINKER_TELEMETRY=0
exec .venv/bin/python -m pytest -q -W ignore::FutureWarning --durations=25 "$@"
