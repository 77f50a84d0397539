"""The trainer as one job of W ranks under torchrun (trainer_service/ranks.py), on real DeepSpeed
over gloo: W=2 computes what W=1 does, for every loss, under ZeRO-2 and ZeRO-3."""

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOLERANCE = 1e-5


def torchrun(world: int, *argv: str, timeout: float = 600) -> None:
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(world), *argv], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


def job(tiny_model_dir: str, tmp_path, world: int, stage: int) -> dict[str, torch.Tensor]:
    state, out = tmp_path / f"state-{world}", tmp_path / f"out-{world}.pt"
    state.mkdir()
    torchrun(world, os.path.join(ROOT, "tests", "trainer", "ranks_job.py"), tiny_model_dir, str(stage),
             str(state), str(out))
    return torch.load(out, weights_only=True)


@pytest.mark.parametrize("stage", [2, 3])
def test_two_ranks_compute_what_one_does(tiny_model_dir, tmp_path, stage):
    """Per-datum logprobs and losses, loss sums and gradient norms of every call, and the adapter
    after three optim steps (one of them from two calls, one of those a single datum, which
    leaves a rank without data), for every loss: W=2 equals W=1 within 1e-5 (fp32). Then a full
    checkpoint loaded into a copy, the copy unloaded and reloaded on its next use: it trains on
    exactly like the original, on 2 ranks as on 1."""
    one, two = job(tiny_model_dir, tmp_path, 1, stage), job(tiny_model_dir, tmp_path, 2, stage)
    assert int(one.pop("world")) == 1 and int(two.pop("world")) == 2
    assert one.keys() == two.keys()
    from trainer_service.losses import LOSSES
    assert {k.split(".")[0] for k in one} == {*LOSSES, "reload"}
    off = {k: (one[k].float() - two[k].float()).abs().max().item() for k in one}
    # the gradient norm is ~100 (summed losses): compared relative to its size
    relative = {k: off[k] / max(1.0, one[k].abs().max().item()) for k in one}
    assert max(relative.values()) < TOLERANCE, sorted(relative.items(), key=lambda kv: kv[1])[-5:]
    assert max(v for k, v in off.items() if ".adapter." in k or "logprobs" in k) < TOLERANCE
    assert int(two["reload.copy.step"]) == int(two["reload.cross_entropy.step"]) == 4
    assert torch.allclose(two["reload.copy.logprobs"], two["reload.cross_entropy.logprobs"], atol=1e-6)
