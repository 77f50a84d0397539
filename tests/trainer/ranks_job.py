"""Run by test_ranks.py under torchrun with W ranks: the same training for every loss, driven
from rank 0 through TrainerEngine (the others follow its commands); rank 0 saves what came out.

    python -m torch.distributed.run --nproc-per-node W tests/trainer/ranks_job.py MODEL STAGE STATE OUT
"""

import sys

import torch

from tinkerd.process import exit_now
from trainer_service.durable import DurableModels
from trainer_service.engine import AdamParams, DatumInput, TrainerEngine
from trainer_service.losses import LOSSES
from trainer_service.lora import LoraSpec

ADAM = AdamParams(learning_rate=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01, grad_clip_norm=1.0)


def batch() -> list[DatumInput]:
    """Five datums of uneven length (an uneven split over 2 ranks), with every loss's inputs."""
    gen = torch.Generator().manual_seed(0)
    data = []
    for n in (9, 6, 12, 4, 7):
        tokens = torch.randint(3, 200, (n + 1,), generator=gen)
        data.append(DatumInput(tokens[:-1].tolist(), {
            "target_tokens": tokens[1:], "weights": torch.rand(n, generator=gen),
            "logprobs": -5.0 - torch.rand(n, generator=gen), "advantages": torch.randn(n, generator=gen)}))
    return data


def train(engine: TrainerEngine, loss: str, data: list[DatumInput]) -> dict[str, torch.Tensor]:
    """Three steps (the second from two calls, the first of them one datum: a rank with none),
    then a forward; every loss, logprob and metric on the way, and the adapter at the end."""
    out: dict[str, torch.Tensor] = {}
    engine.create_model(loss, LoraSpec(rank=4, seed=7))
    calls = [[data], [data[:1], data[1:]], [data]]
    for step, parts in enumerate(calls):
        for j, part in enumerate(parts):
            outputs, metrics = engine.forward_backward(loss, part, loss, {}, forward_only=False)
            out[f"{step}.{j}.loss_sum"] = torch.tensor(metrics["loss:sum"])
            out[f"{step}.{j}.logprobs"] = torch.cat([o["logprobs"] for o in outputs])
            out[f"{step}.{j}.elementwise_loss"] = torch.cat([o["elementwise_loss"] for o in outputs])
        metrics = engine.optim_step(loss, ADAM)
        out[f"{step}.grad_norm"] = torch.tensor(metrics["grad_norm:mean"])
    outputs, _ = engine.forward_backward(loss, data, loss, {}, forward_only=True)
    out["final.logprobs"] = torch.cat([o["logprobs"] for o in outputs])
    for name, t in engine.export_adapter(loss)[0].items():
        out[f"adapter.{name}"] = t
    return out


def save_load_unload(engine: TrainerEngine, state_dir: str, data: list[DatumInput]) -> dict[str, torch.Tensor]:
    """A full checkpoint loaded into a copy; the copy unloaded and brought back by its next use;
    both trained one more step: they must agree."""
    engine.save_state("cross_entropy", f"{state_dir}/ckpt", with_optimizer=True)
    engine.load_state("copy", f"{state_dir}/ckpt", with_optimizer=True)
    engine.unload_model("copy")
    assert not engine.is_resident("copy")
    out = {}
    for model_id in ("cross_entropy", "copy"):
        engine.forward_backward(model_id, data, "cross_entropy", {}, forward_only=False)
        out[f"{model_id}.step"] = torch.tensor(engine.optim_step(model_id, ADAM)["step:max"])
        outputs, _ = engine.forward_backward(model_id, data, "cross_entropy", {}, forward_only=True)
        out[f"{model_id}.logprobs"] = torch.cat([o["logprobs"] for o in outputs])
    return out


def results(engine: TrainerEngine, state_dir: str) -> dict[str, torch.Tensor]:
    """Everything the test compares, from rank 0 (or a one-rank engine in the test's process)."""
    data = batch()
    out = {"world": torch.tensor(engine.ranks.world)}
    for loss in sorted(LOSSES):
        out.update({f"{loss}.{k}": v for k, v in train(engine, loss, data).items()})
    out.update({f"reload.{k}": v for k, v in save_load_unload(engine, state_dir, data).items()})
    return out


def main(model_dir: str, stage: str, state_dir: str, out_path: str) -> None:
    engine = TrainerEngine(model_dir, zero_stage=int(stage), durable=DurableModels(state_dir))
    # Micro-batches of at most 10 tokens: the shares of the 5-datum batch split 2 and 3 ways, so
    # one rank takes an empty micro-step for its collectives to pair up (microbatches.py).
    engine.activation_budget = 10 * engine.token_cost.fixed
    if engine.ranks.leader:
        out = results(engine, state_dir)
        engine.ranks.stop()
        torch.save(out, out_path)
    else:
        engine.ranks.follow(engine)
    exit_now()          # as `tinkerd trainer` ends (trainer_service/ranks.py: _leave_job)


if __name__ == "__main__":
    main(*sys.argv[1:])
