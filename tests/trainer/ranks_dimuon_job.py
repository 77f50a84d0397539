"""Run by test_dimuon.py under torchrun with W ranks: a Dimuon model beside an AdamW one in a ZeRO-2
job, trained, saved with its optimizer state, loaded into a copy that is unloaded and reloaded, and
trained on; rank 0 saves what came out. With one rank (in the test's process) it is the reference.

    python -m torch.distributed.run --nproc-per-node W tests/trainer/ranks_dimuon_job.py MODEL STATE OUT
"""

import sys

import torch

from tinkerd.process import exit_now
from trainer_service.durable import DurableModels
from trainer_service.engine import AdamParams, DatumInput, DimuonParams, TrainerEngine
from trainer_service.lora import LoraSpec

DIMUON = DimuonParams(learning_rate=2e-2, beta1=0.9, damping=1e-4, rank_lr_correction_exponent=0.175,
                      grad_clip_norm=50.0)
ADAM = AdamParams(learning_rate=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, grad_clip_norm=0.0)


def batch() -> list[DatumInput]:
    """Five datums of uneven length: an uneven split over 2 ranks."""
    gen = torch.Generator().manual_seed(0)
    data = []
    for n in (9, 6, 12, 4, 7):
        tokens = torch.randint(3, 200, (n + 1,), generator=gen)
        data.append(DatumInput(tokens[:-1].tolist(), {"target_tokens": tokens[1:],
                                                      "weights": torch.rand(n, generator=gen)}))
    return data


def _step(engine: TrainerEngine, model_id: str, parts: list[list[DatumInput]], params) -> dict[str, float]:
    for part in parts:
        engine.forward_backward(model_id, part, "cross_entropy", {}, forward_only=False)
    return engine.optim_step(model_id, params)


def _logprobs(engine: TrainerEngine, model_id: str, data: list[DatumInput]) -> torch.Tensor:
    outputs, _ = engine.forward_backward(model_id, data, "cross_entropy", {}, forward_only=True)
    return torch.cat([o["logprobs"] for o in outputs])


def results(engine: TrainerEngine, state_dir: str) -> dict[str, torch.Tensor]:
    """Three steps of each model (the second from two calls, one of them a single datum: a rank
    with none), a full checkpoint of the Dimuon model loaded into a copy, the copy unloaded and
    reloaded by its next use, and one more step of the original and the copy."""
    data, out = batch(), {"world": torch.tensor(engine.ranks.world)}
    engine.create_model("dimuon", LoraSpec(rank=4, seed=7, optimizer="dimuon"))
    engine.create_model("adamw", LoraSpec(rank=4, seed=7))
    for step, parts in enumerate([[data], [data[:1], data[1:]], [data]]):
        out[f"dimuon.{step}.grad_norm"] = torch.tensor(_step(engine, "dimuon", parts, DIMUON)["grad_norm:mean"])
        out[f"adamw.{step}.grad_norm"] = torch.tensor(_step(engine, "adamw", parts, ADAM)["grad_norm:mean"])
    engine.save_state("dimuon", f"{state_dir}/ckpt", with_optimizer=True)
    engine.load_state("copy", f"{state_dir}/ckpt", with_optimizer=True)
    engine.unload_model("copy")
    for model_id in ("dimuon", "copy"):
        out[f"{model_id}.step"] = torch.tensor(_step(engine, model_id, [data], DIMUON)["step:max"])
        out[f"{model_id}.logprobs"] = _logprobs(engine, model_id, data)
    out["adamw.logprobs"] = _logprobs(engine, "adamw", data)
    for name, t in engine.export_adapter("dimuon")[0].items():
        out[f"adapter.{name}"] = t
    return out


def main(model_dir: str, state_dir: str, out_path: str) -> None:
    engine = TrainerEngine(model_dir, zero_stage=2, durable=DurableModels(state_dir))
    if engine.ranks.leader:
        out = results(engine, state_dir)
        engine.ranks.stop()
        torch.save(out, out_path)
    else:
        engine.ranks.follow(engine)
    exit_now()


if __name__ == "__main__":
    main(*sys.argv[1:])
