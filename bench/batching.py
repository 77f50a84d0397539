"""Should forward_backward of several models run as one pass? The measurement that decides.

On the trainer engine in this process: two models' forward_backward calls of B sequences each,
run one after the other (what tinkerd does), against one forward_backward of all 2B sequences
(the best one mixed-adapter pass could do: same tokens, one pass, no per-adapter grouping).
The ratio is the most batching across models could gain.
"""

from __future__ import annotations

import torch

from bench.common import Context, Row, median_time


def run(ctx: Context) -> list[Row]:
    from trainer_service.engine import DatumInput, TrainerEngine
    from trainer_service.lora import LoraSpec

    rows = []
    for name in ("tiny", "smollm2"):
        model = ctx.models.get(name)
        if model is None:
            continue
        engine = TrainerEngine(model, zero_stage=2)
        for m in ("a", "b"):
            engine.create_model(m, LoraSpec(rank=16, seed=0))
        length, batch = (64, 4)
        gen = torch.Generator().manual_seed(0)
        data = [DatumInput(torch.randint(0, 1000, (length,), generator=gen).tolist(),
                           {"target_tokens": torch.randint(0, 1000, (length,), generator=gen),
                            "weights": torch.ones(length)}) for _ in range(2 * batch)]

        def separate():
            engine.forward_backward("a", data[:batch], "cross_entropy", {}, forward_only=False)
            engine.forward_backward("b", data[batch:], "cross_entropy", {}, forward_only=False)

        def joint():
            engine.forward_backward("a", data, "cross_entropy", {}, forward_only=False)

        n = ctx.iters(5)
        t_sep, t_joint = median_time(separate, n), median_time(joint, n)
        gain = t_sep / t_joint
        rows.append(Row("batching", f"{name}: 2 models x {batch}x{length} tokens, separate vs one pass",
                        1e3 * t_sep, 1e3 * t_joint, "ms", ratio=gain,
                        note=f"one pass would be x{gain:.2f} faster at best"))
        for m in ("a", "b"):
            engine.delete_model(m)
        del engine
    return rows
