#!/usr/bin/env bash
# Sets up and runs every test (unit + e2e against a real `tinkerd up` on a tiny model).
# Two pytest workers share the 2 cores (each service runs one thread, so one test seldom fills
# both); the few tests that measure time against a bound run afterwards, alone (marker `serial`).
# With arguments, runs just `pytest ARGS` in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TINKER_TELEMETRY=0
# The stacks' trainers and samplers share the cores by who is busy (tinkerd/cores.py), as users'
# do; the test processes themselves keep one thread.
export TINKERD_CPU_THREADS=auto
# This repo's bytecode, made once here: with PYTHONDONTWRITEBYTECODE set (as on these machines) every
# service and client process the tests start would compile it from source again.
.venv/bin/python -m compileall -q -j 0 gateway trainer_service sampler_service tinkerd launcher harness bench tests >/dev/null || true
pytest=(.venv/bin/python -m pytest -q -W ignore::FutureWarning --durations=25)
if [ "$#" -gt 0 ]; then
    exec "${pytest[@]}" "$@"
fi
status=0
"${pytest[@]}" -n 2 -m "not serial" || status=$?
# Only the files that mark tests serial (collecting all ~100 files again took ~8 s of the ~45), in
# the order a full collection runs them (grep's own order is the filesystem's).
"${pytest[@]}" -m serial $(grep -rl "mark.serial" tests --include='test_*.py' | sort) || status=$?
exit "$status"
