"""Startup: `tinkerd up` to ready, and to the first finished training step through the SDK.
Raw: the engines alone, each built in a fresh process, one after the other (the DeepSpeed trainer
engine with one LoRA model, then vllm.LLM with LoRA enabled): what a serial start would take.
The smoke run (--quick) times the start of its shared stack and builds no raw engines."""

from __future__ import annotations

import subprocess
import sys
import time

from bench.common import REPO, Context, Row, tinkerd_up


_BUILD_TRAINER = """
import sys, time
t0 = time.perf_counter()
from trainer_service.engine import TrainerEngine
from trainer_service.lora import LoraSpec
TrainerEngine(sys.argv[1]).create_model("m", LoraSpec(rank=8, seed=0))
print(time.perf_counter() - t0)
"""
_BUILD_VLLM = """
import os, sys, time
t0 = time.perf_counter()
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
from vllm import LLM
LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=1024, enable_lora=True,
    max_loras=4, max_lora_rank=64)
print(time.perf_counter() - t0)
"""


def raw_seconds(model_dir: str) -> float:
    """Each engine built (imports included) in a fresh process, one after the other."""
    total = 0.0
    for script in (_BUILD_TRAINER, _BUILD_VLLM):
        out = subprocess.run([sys.executable, "-c", script, model_dir], capture_output=True, text=True,
                             check=True, cwd=REPO)
        total += float(out.stdout.strip().splitlines()[-1])
    return total


def run(ctx: Context) -> list[Row]:
    import tinker
    from tinker import types

    rows = []
    for name, model in ctx.models.items():
        raw = None if ctx.quick else raw_seconds(model)   # the smoke run: two engine builds fewer
        with tinkerd_up(ctx, f"startup-{name}", model) as stack:
            ready, t0 = stack.start_seconds, time.perf_counter()
            tc = tinker.ServiceClient(base_url=stack.url).create_lora_training_client(base_model=model, rank=8).result()
            datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3, 4]),
                                loss_fn_inputs={"target_tokens": [2, 3, 4, 5], "weights": [1.0] * 4})
            tc.forward_backward([datum], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
            first_step = ready + time.perf_counter() - t0
        rows.append(Row("startup", f"{name}: tinkerd up to ready", ready, raw, "s",
                        ratio=None if raw is None else raw / ready,
                        note="raw: trainer engine, then vllm.LLM, each built in a fresh process"))
        rows.append(Row("startup", f"{name}: tinkerd up to first finished step", first_step, None, "s"))
    return rows
