"""Should forward_backward of several models run as one pass? The measurements that decide.

1. Upper bound, on the trainer engine in this process: two models' forward_backward calls of B
   sequences each, run one after the other (what tinkerd does), against one forward_backward of
   all 2B sequences (the best one mixed-adapter pass could do: same tokens, one pass, no
   per-adapter grouping). The ratio is the most batching across models could gain.
2. A prototype of the design that would make aggregate throughput grow with tenants: K tenants'
   micro-batches in one base forward/backward, every targeted Linear of the base model wrapped
   in `RowLora` (the frozen Linear once over all rows, then each tenant's rows through its own
   A and B: segments, as multi-LoRA serving does for sampling). K passes of B sequences against
   one pass of K*B, the same modules either way; each tenant's gradients from the joint pass are
   checked against its own pass. Not the engine: no DeepSpeed, no optimizer (each tenant's AdamW
   would still step on its own). fp32 on the CPU in `python -m bench`; on a GPU (no vLLM needed)
   `python -m bench.batching --device cuda --shape 1b` runs it in bf16, per tenant one sequence of
   512 tokens by default: the small per-tenant batches where one pass has the most to gain.
"""

from __future__ import annotations

import torch

from bench.common import Context, Row, in_turn, median_time

TENANTS = (2, 4, 8)
BATCH, LENGTH, RANK = 4, 64, 16


class RowLora(torch.nn.Module):
    """A frozen Linear and `tenants` LoRA adapters; the rows of the batch in `segments[i] =
    (tenant, first, end)` go through that tenant's adapter (the segments object is shared by
    every layer of the model and set before each pass)."""

    def __init__(self, base: torch.nn.Linear, tenants: int, rank: int, scale: float, segments: list,
                 generator: torch.Generator):
        super().__init__()
        self.base, self.scale, self.segments = base, scale, segments
        like = {"device": base.weight.device, "dtype": base.weight.dtype}     # drawn on the host, then moved
        # B is random too (not PEFT's zeros), so that every A gets a gradient to compare
        self.lora_a = torch.nn.ParameterList(
            torch.nn.Parameter((0.01 * torch.randn(rank, base.in_features, generator=generator)).to(**like))
            for _ in range(tenants))
        self.lora_b = torch.nn.ParameterList(
            torch.nn.Parameter((0.01 * torch.randn(base.out_features, rank, generator=generator)).to(**like))
            for _ in range(tenants))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        delta = torch.cat([(x[first:end] @ self.lora_a[k].T) @ self.lora_b[k].T
                           for k, first, end in self.segments])
        return self.base(x) + self.scale * delta


def row_lora_model(model_dir: str, tenants: int, device: str = "cpu",
                   dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, list]:
    """The base model with every Linear tinkerd targets by default (attention, MLP, lm_head)
    wrapped in RowLora; returns it and the segments list its layers share."""
    from transformers import AutoModelForCausalLM

    from trainer_service.lora import LORA_ALPHA, linear_groups

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    model.requires_grad_(False)
    targets = {leaf for leaves in linear_groups(model).values() for leaf in leaves}
    segments, generator = [], torch.Generator().manual_seed(0)
    for qualified, module in list(model.named_modules()):
        parent, _, leaf = qualified.rpartition(".")
        if isinstance(module, torch.nn.Linear) and leaf in targets:
            wrapped = RowLora(module, tenants, RANK, LORA_ALPHA / RANK, segments, generator)
            setattr(model.get_submodule(parent) if parent else model, leaf, wrapped)
    return model, segments


def _loss(model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")


def prototype_row(name: str, model_dir: str, tenants: int, rounds: int, *, device: str = "cpu",
                  dtype: torch.dtype = torch.float32, batch: int = BATCH, length: int = LENGTH) -> Row:
    model, segments = row_lora_model(model_dir, tenants, device, dtype)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, min(1000, model.config.vocab_size), (tenants * batch, length + 1), generator=gen)
    ids, targets = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    params = [p for p in model.parameters() if p.requires_grad]

    def separate() -> torch.Tensor:
        total = 0.0
        for k in range(tenants):
            rows = slice(k * batch, (k + 1) * batch)
            segments[:] = [(k, 0, batch)]
            loss = _loss(model, ids[rows], targets[rows])
            loss.backward()
            total = total + loss.detach()
        return total

    def joint() -> torch.Tensor:
        segments[:] = [(k, k * batch, (k + 1) * batch) for k in range(tenants)]
        loss = _loss(model, ids, targets)
        loss.backward()
        return loss.detach()

    def grads_after(run) -> list[torch.Tensor]:
        for p in params:
            p.grad = None
        run()
        return [p.grad.float() for p in params]

    from bench.trainer_only import Timed       # the clock read between synchronizations on a GPU

    worst = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
                for a, b in zip(grads_after(separate), grads_after(joint)))
    tokens_in_all, cuda = tenants * batch * length, device == "cuda"
    t_separate, t_joint = in_turn([Timed(separate, tokens_in_all, cuda), Timed(joint, tokens_in_all, cuda)], rounds)
    gain = t_separate / t_joint
    dtype_name = str(dtype).removeprefix("torch.")
    precision = "float32 summation order" if dtype == torch.float32 else f"{dtype_name} rounding"
    return Row("batching", f"{name}: prototype, {tenants} tenants x {batch}x{length} tokens, rank {RANK}, "
                           f"one pass with per-row LoRA vs a pass per tenant (forward + backward)"
                           + ("" if device == "cpu" else f", {device} {dtype_name}"),
               1e3 * t_joint, 1e3 * t_separate, "ms", ratio=gain,
               note=f"aggregate tokens/s x{gain:.2f}; each tenant's gradients as from its own pass within "
                    f"{worst:.1e} of their largest ({precision})")


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
        for tenants in (TENANTS[:1] if ctx.quick else TENANTS):
            rows.append(prototype_row(name, model, tenants, ctx.iters(5 if name == "tiny" else 3, 1)))
    return rows


def main(argv=None) -> None:
    """The prototype on one device, alone (no vLLM, no other bench): a random-init model of a
    bench.trainer_only shape, K tenants against K passes, in turn."""
    import argparse
    import tempfile

    from bench.trainer_only import SHAPES, Setup, build_model, free_memory

    parser = argparse.ArgumentParser(prog="python -m bench.batching", description=main.__doc__)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--batch", type=int, default=1, help="sequences per tenant")
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--tenants", type=int, nargs="+", default=list(TENANTS))
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    setup = Setup(device=args.device, shape=args.shape, dtype=dtype, batch=args.batch, length=args.length,
                  rank=RANK, steps=args.rounds, warmup=1)
    with tempfile.TemporaryDirectory(prefix="batching-") as work:
        build_model(setup, work)          # saved for the prototype to load; the copy returned is dropped
        free_memory()
        for tenants in args.tenants:
            row = prototype_row(args.shape, work, tenants, args.rounds, device=args.device,
                                dtype=getattr(torch, dtype), batch=args.batch, length=args.length)
            print(f"| {row.case} | one pass {row.ours:.1f} ms | a pass per tenant {row.raw:.1f} ms | "
                  f"x{row.ratio:.2f} | {row.note} |", flush=True)
            free_memory()


if __name__ == "__main__":
    main()
