"""Dimuon (trainer_service/dimuon.py) against a plain reference written here, one matrix at a time
in float64; then on a real TrainerEngine: a Dimuon model trains, refuses Adam's parameters, resumes
exactly from a full checkpoint and from its durable state, runs as stage 0 beside ZeRO-2 models
(also over two ranks under torchrun), and is refused under ZeRO-3."""

import math
import os
import subprocess
import sys

import pytest
import torch

from tinkerd.errors import UserError
from trainer_service import dimuon
from trainer_service.dimuon import Dimuon
from trainer_service.durable import DurableModels
from trainer_service.engine import AdamParams, DatumInput, DimuonParams, TrainerEngine
from trainer_service.lora import LoraSpec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RANK = 4
SHAPES = [(RANK, 16), (16, RANK), (RANK, 8), (8, RANK), (RANK, RANK), (40, RANK), (RANK, 16)]


def reference_step(w, m, g, *, lr, beta1, damping, exponent, rank):
    """Dimuon on one matrix, as the docs put it: momentum; the damped row/column preconditioner;
    five quintic Newton-Schulz steps for the matrix sign; a step of Frobenius norm
    lr * sqrt(rank), rank-corrected relative to rank 32. Returns the new weight and momentum."""
    m = beta1 * m + (1 - beta1) * g
    flip = m.shape[0] > m.shape[1]
    x = m.T if flip else m
    if x.abs().max() == 0:
        return w, m
    sq = x ** 2
    rows, cols = sq.mean(1, keepdim=True) / sq.mean(), sq.mean(0, keepdim=True) / sq.mean()
    x = x * (rows + damping) ** -0.25 * (cols + damping) ** -0.25
    x = x / x.norm()
    for _ in range(5):
        a = x @ x.T
        x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
    step = lr * (rank / 32) ** -exponent * math.sqrt(rank) * x / x.norm()
    return w - (step.T if flip else step), m


def _matrices(seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for shape in SHAPES]


def _settings(step):
    return dict(lr=[0.05, 0.02, 0.1][step], beta1=[0.9, 0.5, 0.0][step], damping=[1e-4, 1e-2, 1.0][step],
                rank_lr_correction_exponent=[0.175, 0.0, 0.5][step])


def test_dimuon_steps_as_the_plain_reference():
    """Three steps with other settings each (a schedule), every matrix shape a LoRA model has (a,
    b, square, one with no gradient): weights and momentum within 1e-5 of the float64 reference."""
    weights = [torch.nn.Parameter(t) for t in _matrices(0)]
    ref_w = [t.double() for t in _matrices(0)]
    ref_m = [torch.zeros_like(t) for t in ref_w]
    opt = Dimuon(weights, RANK)
    for step in range(3):
        grads = _matrices(10 + step)
        grads[2] = torch.zeros_like(grads[2])        # a matrix with no gradient yet (LoRA a at b = 0)
        for p, g in zip(weights, grads):
            p.grad = g.clone()
        settings = _settings(step)
        opt.param_groups[0].update(settings)
        opt.step()
        for i, g in enumerate(grads):
            ref_w[i], ref_m[i] = reference_step(
                ref_w[i], ref_m[i], g.double(), lr=settings["lr"], beta1=settings["beta1"],
                damping=settings["damping"], exponent=settings["rank_lr_correction_exponent"], rank=RANK)
    for i, (p, w, m) in enumerate(zip(weights, ref_w, ref_m)):
        assert (p.detach().double() - w).abs().max() < 1e-5, i
        assert (opt.state[p]["momentum"].double() - m).abs().max() < 1e-6, i


def test_a_nearly_low_rank_momentum_keeps_its_small_directions():
    """A LoRA matrix's momentum is often nearly low rank (one direction and noise 1e-3 below it):
    its matrix sign still matches the float64 reference to 1e-4 (Frobenius, relative), as float32
    Newton-Schulz on the matrix itself does; the small directions carry half the step."""
    gen = torch.Generator().manual_seed(5)
    for rows, cols in ((RANK, 1024), (1024, RANK), (RANK, RANK)):
        g = torch.randn(rows, 1, generator=gen) @ torch.randn(1, cols, generator=gen)
        g += 1e-3 * torch.randn(rows, cols, generator=gen)
        w = torch.nn.Parameter(torch.zeros(rows, cols))
        w.grad = g.clone()
        opt = Dimuon([w], RANK)
        opt.param_groups[0].update(lr=0.1, beta1=0.0)
        opt.step()
        ref, _ = reference_step(torch.zeros(rows, cols, dtype=torch.float64), torch.zeros_like(g, dtype=torch.float64),
                                g.double(), lr=0.1, beta1=0.0, damping=1e-4, exponent=0.175, rank=RANK)
        assert (w.detach().double() - ref).norm() < 1e-4 * ref.norm(), (rows, cols)


def test_each_matrix_moves_by_the_documented_norm_whatever_the_gradients_scale():
    """From zero momentum: every matrix with a gradient moves by lr * sqrt(rank) * (rank/32)^-e
    (Frobenius), one without none; gradients a billion times smaller take the same step."""
    moved = []
    for scale in (1.0, 1e-9):
        weights = [torch.nn.Parameter(t) for t in _matrices(0)]
        for p, g in zip(weights, _matrices(1)):
            p.grad = g * scale
        weights[3].grad = None
        opt = Dimuon(weights, RANK)
        opt.param_groups[0].update(lr=0.03, beta1=0.9, rank_lr_correction_exponent=0.175)
        opt.step()
        moved.append([p.detach() - t for p, t in zip(weights, _matrices(0))])
    expected = 0.03 * math.sqrt(RANK) * (RANK / 32) ** -0.175
    for i, delta in enumerate(moved[0]):
        assert abs(delta.norm().item() - (0 if i == 3 else expected)) < 1e-5 * expected, i
        assert (delta - moved[1][i]).abs().max() < 1e-5, i


@pytest.mark.parametrize("on_host", [True, False], ids=["read on the host", "decided on the device"])
def test_a_skipped_step_leaves_weights_and_momentum_as_they_were(on_host, monkeypatch):
    """found_inf = 1 (a non-finite gradient norm): the step is a no-op though the gradients are
    NaN; found_inf = 0 then steps as ever. Both ways: read on the host, and decided on the device
    without reading it (a GPU's, here on the CPU), which steps as the host does."""
    monkeypatch.setattr(dimuon, "read_on_host", lambda found_inf: on_host)
    weights = [torch.nn.Parameter(t) for t in _matrices(0)]
    opt = Dimuon(weights, RANK)
    opt.param_groups[0].update(lr=0.05)
    for p, g in zip(weights, _matrices(1)):
        p.grad = g
    opt.step()
    before = [p.detach().clone() for p in weights], [opt.state[p]["momentum"].clone() for p in weights]
    for p in weights:
        p.grad = torch.full_like(p, math.nan)
    opt.found_inf = torch.tensor(1.0)
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(weights, before[0]))
    assert all(torch.equal(opt.state[p]["momentum"], b) for p, b in zip(weights, before[1]))
    for p, g in zip(weights, _matrices(2)):
        p.grad = g
    opt.found_inf = torch.tensor(0.0)
    opt.step()
    assert all(not torch.equal(p, b) and torch.isfinite(p).all() for p, b in zip(weights, before[0]))
    twin = [torch.nn.Parameter(t) for t in _matrices(0)]
    plain = Dimuon(twin, RANK)
    plain.param_groups[0].update(lr=0.05)
    for grads in (_matrices(1), _matrices(2)):
        for p, g in zip(twin, grads):
            p.grad = g
        plain.step()
    assert all((p - q).abs().max() < 1e-6 for p, q in zip(weights, twin))


# ---- on a TrainerEngine ---------------------------------------------------------------------

def _datum(tokens):
    return DatumInput(tokens[:-1], {"target_tokens": torch.tensor(tokens[1:]), "weights": torch.ones(len(tokens) - 1)})


DATA = [_datum([5, 6, 7, 8, 9, 10, 11, 12]), _datum([20, 21, 22, 23, 24, 25])]
DIMUON = DimuonParams(learning_rate=0.05, beta1=0.9, damping=1e-4, rank_lr_correction_exponent=0.175,
                      grad_clip_norm=0.0)
ADAM = AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.0, grad_clip_norm=0.0)


def _train(engine, model_id, params, steps=1):
    losses = []
    for _ in range(steps):
        _, metrics = engine.forward_backward(model_id, DATA, "cross_entropy", {}, forward_only=False)
        losses.append(metrics["loss:sum"])
        engine.optim_step(model_id, params)
    return losses


def _adapter(engine, model_id):
    return engine.export_adapter(model_id)[0]


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_dimuon_model_learns_refuses_adam_and_resumes_exactly(tiny_model_dir, tmp_path):
    """It learns, lands elsewhere than AdamW from the same seed, refuses AdamParams (and an AdamW
    model DimuonParams); its full checkpoint holds its momentum: a copy made from it, and the model
    itself unloaded and reloaded, train on bit for bit like its twin that stayed."""
    engine = TrainerEngine(tiny_model_dir, zero_stage=2, durable=DurableModels(str(tmp_path / "state")))
    for model_id in ("d", "twin", "leaves"):
        engine.create_model(model_id, LoraSpec(rank=8, seed=3, optimizer="dimuon"))
    engine.create_model("a", LoraSpec(rank=8, seed=3))
    losses = _train(engine, "d", DIMUON, steps=4)
    assert losses[-1] < 0.9 * losses[0], losses
    _train(engine, "a", ADAM, steps=4)
    assert max((x - y).abs().max().item() for x, y in zip(_adapter(engine, "d").values(),
                                                           _adapter(engine, "a").values())) > 1e-3
    with pytest.raises(UserError, match="created with the dimuon optimizer; optim_step got AdamParams"):
        engine.optim_step("d", ADAM)
    with pytest.raises(UserError, match="created with the adamw optimizer; optim_step got DimuonParams"):
        engine.optim_step("a", DIMUON)

    ckpt = str(tmp_path / "ckpt")
    engine.save_state("d", ckpt, with_optimizer=True)
    assert os.listdir(os.path.join(ckpt, "optimizer")) == ["dimuon.safetensors"]
    engine.load_state("copy", ckpt, with_optimizer=True)
    with pytest.raises(UserError, match="holds dimuon optimizer state; a adamw model cannot resume"):
        engine.load_state("wrong", ckpt, with_optimizer=True, optimizer="adamw")
    assert engine.get("copy").spec.optimizer == "dimuon"
    fresh = engine.load_state("fresh", ckpt, with_optimizer=False)       # weights only: AdamW by default
    assert fresh.spec.optimizer == "adamw"
    for model_id in ("twin", "leaves"):
        _train(engine, model_id, DIMUON, steps=4)
    engine.unload_model("leaves")
    for model_id in ("d", "copy", "twin", "leaves"):
        _train(engine, model_id, DIMUON, steps=2)
    assert _same(_adapter(engine, "d"), _adapter(engine, "copy"))
    assert _same(_adapter(engine, "twin"), _adapter(engine, "leaves"))
    assert _same(_adapter(engine, "d"), _adapter(engine, "twin"))
    assert engine.get("leaves").step == 6


def test_a_dimuon_model_runs_stage_0_beside_zero_2_models(tiny_model_dir, tmp_path):
    """In a ZeRO-2 engine (kept on one rank) a Dimuon model's engine runs as stage 0 and trains,
    saves and reloads exactly as in a stage-0 trainer; the AdamW model beside it stays ZeRO-2.
    Under ZeRO-3, which partitions the matrices, a Dimuon model is refused."""
    kept = TrainerEngine(tiny_model_dir, zero_stage=2, keep_zero_stage=True)
    plain = TrainerEngine(tiny_model_dir, zero_stage=0)
    for engine in (kept, plain):
        engine.create_model("d", LoraSpec(rank=4, seed=5, optimizer="dimuon"))
        _train(engine, "d", DIMUON, steps=2)
    kept.create_model("a", LoraSpec(rank=4, seed=5))
    _train(kept, "a", ADAM)
    assert kept.get("a").engine.zero_optimization_stage() == 2 and kept.get("d").engine.zero_optimization_stage() == 0
    kept.save_state("d", str(tmp_path / "ckpt"), with_optimizer=True)
    kept.load_state("copy", str(tmp_path / "ckpt"), with_optimizer=True)
    for engine, model_id in ((kept, "copy"), (plain, "d")):
        _train(engine, model_id, DIMUON)
    assert _same(_adapter(kept, "copy"), _adapter(plain, "d"))

    zero3 = TrainerEngine(tiny_model_dir, zero_stage=3)
    with pytest.raises(UserError, match="ZeRO-3"):
        zero3.create_model("d", LoraSpec(rank=4, seed=5, optimizer="dimuon"))


def test_two_ranks_train_a_dimuon_model_as_one_does(tiny_model_dir, tmp_path):
    """A ZeRO-2 job of two ranks under torchrun (a Dimuon model at stage 0 beside a ZeRO-2 AdamW
    one): grad norms, logprobs and the adapter as one rank computes them (1e-5), and the Dimuon
    model's full checkpoint, loaded and reloaded, trains on exactly like the original."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from ranks_dimuon_job import results

    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one = results(TrainerEngine(tiny_model_dir, zero_stage=2, durable=DurableModels(str(tmp_path / "one"))),
                  str(tmp_path / "one"))
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           os.path.join(ROOT, "tests", "trainer", "ranks_dimuon_job.py"), tiny_model_dir,
                           str(tmp_path / "two"), str(tmp_path / "out.pt")],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    two = torch.load(tmp_path / "out.pt", weights_only=True)
    assert int(one.pop("world")) == 1 and int(two.pop("world")) == 2 and one.keys() == two.keys()
    off = {k: (one[k].float() - two[k].float()).abs().max().item() / max(1.0, one[k].abs().max().item()) for k in one}
    assert max(off.values()) < 1e-5, sorted(off.items(), key=lambda kv: kv[1])[-5:]
    assert int(two["copy.step"]) == int(two["dimuon.step"]) == 4
    assert torch.equal(two["copy.logprobs"], two["dimuon.logprobs"])
