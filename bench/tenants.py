"""Many tenants: per-step time and memory as the number of resident LoRA models grows.

Through the SDK against `tinkerd up`: N training clients (rank 8) each take a step and push a
sampler snapshot, so the trainer holds N adapters with optimizer state and the sampler N
snapshots. Then a training step round-robin over the N models, and a 16-token sample
round-robin over the N snapshots. The raw reference is the same step with one resident model.
"""

from __future__ import annotations

import time

from bench.common import Context, Row, median_time, new_dir, rss_mib
from harness.stack import running_stack, service_pids

TEXT = "the quick brown fox jumps over the lazy dog and the cat sat on the mat"


def run(ctx: Context) -> list[Row]:
    import tinker
    from tinker import types
    from transformers import AutoTokenizer

    model = ctx.models["tiny"]
    counts = (1, 4) if ctx.quick else (1, 4, 16, 32)
    tok = AutoTokenizer.from_pretrained(model)
    ids = tok.encode(TEXT)
    data = [types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})] * 4
    prompt = types.ModelInput.from_ints(ids[:8])
    params = types.SamplingParams(max_tokens=16, temperature=0.0, stop=[])
    adam = types.AdamParams(learning_rate=1e-3)
    rows: list[Row] = []
    with running_stack(model, new_dir(ctx, "tenants"), "--max-loras", "8", "--max-cpu-loras", "64") as stack:
        pids = service_pids(stack.pid)
        service = tinker.ServiceClient(base_url=stack.url)
        trainers, samplers = [], []
        base_step = None
        for n in counts:
            while len(trainers) < n:
                tc = service.create_lora_training_client(base_model=model, rank=8, seed=len(trainers)).result()
                tc.forward_backward(data, "cross_entropy").result()
                tc.optim_step(adam).result()
                trainers.append(tc)
                samplers.append(tc.save_weights_and_get_sampling_client().result())
            turn = iter(range(1 << 30))

            def step():
                tc = trainers[next(turn) % n]
                fb = tc.forward_backward(data, "cross_entropy")
                tc.optim_step(adam).result()
                fb.result()

            def sample():
                samplers[next(turn) % n].sample(prompt, 1, params).result()

            t_step = median_time(step, ctx.iters(3 * n if n < 16 else n, 2), warmup=1)
            t_sample = median_time(sample, ctx.iters(2 * n if n < 16 else n, 2), warmup=1)
            base_step = base_step or t_step
            trainer_mib, sampler_mib = rss_mib(pids["trainer"]), rss_mib(pids["sampler"])
            rows.append(Row("tenants", f"{n} resident adapters: train step (4x{len(ids) - 1} tokens)",
                            1e3 * t_step, 1e3 * base_step, "ms", ratio=base_step / t_step,
                            note=f"trainer RSS {trainer_mib:.0f} MiB"))
            rows.append(Row("tenants", f"{n} resident snapshots: sample 16 tokens", 1e3 * t_sample, None, "ms",
                            note=f"sampler RSS {sampler_mib:.0f} MiB"))
    return rows
