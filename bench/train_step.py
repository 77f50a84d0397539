"""Training step through the API vs the raw DeepSpeed engine.

Ours: warm forward_backward + optim_step through the SDK against `tinkerd up`.
Raw: in this process, the same model with the same LoRA (PEFT) under a DeepSpeed ZeRO-2 engine
with torch AdamW, on the same batch: forward, cross-entropy sum, engine.backward, engine.step.
The raw engine runs first and is freed before the stack starts, so they never share the CPU.
"""

from __future__ import annotations

import gc

import torch

from bench.common import Context, Row, median_time, new_dir
from tinkerd.stack import running_stack

RANK = 16
BATCH, LENGTH = 4, 64


def _batch(vocab: int):
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, min(vocab, 1000), (LENGTH + 1,), generator=gen).tolist() for _ in range(BATCH)]


def raw_step_seconds(model_dir: str, sequences: list[list[int]], iters: int) -> float:
    import deepspeed
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from trainer_service.engine import deepspeed_config, init_distributed_once
    from trainer_service.lora import LoraSpec, linear_groups, peft_config

    init_distributed_once()
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    base.requires_grad_(False)
    model = get_peft_model(base, peft_config(linear_groups(base), LoraSpec(rank=RANK, seed=0)))
    params = [p for p in model.parameters() if p.requires_grad]
    config = dict(deepspeed_config(2), gradient_accumulation_steps=1)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(params, lr=1e-4), config=config)
    ids = torch.tensor([s[:-1] for s in sequences])
    targets = torch.tensor([s[1:] for s in sequences])

    def step():
        logits = engine(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
        engine.backward(loss)
        engine.step()

    seconds = median_time(step, iters, warmup=2)
    engine.destroy()
    del engine, model, base
    gc.collect()
    return seconds


def api_step_seconds(model_dir: str, sequences: list[list[int]], iters: int, state_dir: str) -> float:
    import tinker
    from tinker import types

    data = [types.Datum(model_input=types.ModelInput.from_ints(s[:-1]),
                        loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * LENGTH}) for s in sequences]
    with running_stack(model_dir, state_dir) as stack:
        tc = tinker.ServiceClient(base_url=stack.url).create_lora_training_client(
            base_model=model_dir, rank=RANK, seed=0).result()
        adam = types.AdamParams(learning_rate=1e-4)

        def step():
            fb = tc.forward_backward(data, "cross_entropy")
            op = tc.optim_step(adam)
            fb.result()
            op.result()
        return median_time(step, iters, warmup=2)


def run(ctx: Context) -> list[Row]:
    from transformers import AutoConfig

    rows = []
    for name, model in ctx.models.items():
        sequences = _batch(AutoConfig.from_pretrained(model).vocab_size)
        iters = ctx.iters(15 if name == "tiny" else 6)
        raw = raw_step_seconds(model, sequences, iters)
        ours = api_step_seconds(model, sequences, iters, new_dir(ctx, f"train-{name}"))
        rows.append(Row("train_step", f"{name}: fwd_bwd+optim, {BATCH}x{LENGTH} tokens, rank {RANK}",
                        1e3 * ours, 1e3 * raw, "ms", ratio=raw / ours, target=">= 0.9"))
    return rows
