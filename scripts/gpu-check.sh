#!/usr/bin/env bash
# The checks that need a GPU, on a CUDA host that has torch, transformers, PEFT and DeepSpeed
# (no vLLM needed): the CPU-only suite (scripts/test.sh) skips the `gpu` tests with a reason.
#   bash scripts/gpu-check.sh [OUT_DIR]
# Runs bench/trainer_only.py on the 1B shape (8x512 tokens, LoRA rank 32, bf16): plain PyTorch +
# PEFT vs raw DeepSpeed vs tinkerd's engine vs the SDK through the gateway and trainer services,
# tenants; tenants batched in one pass (prototype); SmolLM2's shape; then the trainer, weight-transport and
# bf16 tests (the `gpu` ones among them). Results land in OUT_DIR (6 files).
# Extra packages can sit beside the repo (see docs/gpu.md): wheels in .whl/, pure-Python
# packages (DeepSpeed) in .dev/site/; `.venv/bin/python scripts/gpu_bundle.py` makes both.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu-results}"
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/tinkerd-site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/tinkerd-site:${PYTHONPATH:-}"
fi
[ -d .dev/site ] && export PYTHONPATH="$PWD/.dev/site:${PYTHONPATH:-}"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TINKER_TELEMETRY=0
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))" || exit 1
status=0
# Each phase has its own time limit, so one that hangs leaves the others their results.
bench=(python3 -m bench.trainer_only --device cuda --dtype bfloat16)
timeout 270 "${bench[@]}" --shape 1b --batch 8 --length 512 --rank 32 --tenants --sdk --profile --json "$out/1b.json" \
  > "$out/1b.log" 2>&1 || status=$?
# Tenants batched: K tenants' rows in one base forward/backward with per-row LoRA (bench/batching.py's
# prototype), against a pass per tenant, one 512-token sequence each (1B shape, bf16). (The chunked-logits
# run this replaces settled the GPU default on 2026-12-04: 0.884x chunked, 0.925x whole.)
timeout 70 python3 -m bench.batching --device cuda --shape 1b --batch 1 --length 512 --tenants 2 4 8 \
  > "$out/1b-batching.log" 2>&1 || status=$?
timeout 55 "${bench[@]}" --shape smollm2 --batch 4 --length 64 --rank 16 --json "$out/smollm2.json" \
  > "$out/smollm2.log" 2>&1 || status=$?
grep -h -E "^\||step cost|^trainer_only" "$out/1b.log" "$out/1b-batching.log" "$out/smollm2.log"
# 4 workers: the 100 tests took 152 s one at a time on the H200 host (16 cores).
timeout 200 python3 -m pytest -q -n 4 -m "not e2e" -p no:cacheprovider -rA tests/unit/test_weight_transport.py \
  tests/unit/test_gpu_placement.py tests/trainer/test_weight_push.py tests/trainer/test_trainer_only_bench.py \
  tests/trainer/test_bf16_training.py tests/trainer/test_engine.py tests/trainer/test_adapter_switch.py \
  tests/trainer/test_durable.py tests/trainer/test_prefix_tree.py \
  > "$out/tests.log" 2>&1 || status=$?
grep -E "^(PASSED|SKIPPED).*(gpu|cuda)|^FAILED|^ERROR| passed| failed" "$out/tests.log"
exit "$status"
