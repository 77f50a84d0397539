"""TrainerEngine on a real DeepSpeed engine (gloo, one process): Tinker's accumulate-then-step
semantics and tenant isolation, under ZeRO-2 (on one rank: stage 0) and ZeRO-3; the stage-0
path against ZeRO-2 itself (keep_zero_stage), and ZeRO-2 checkpoints resuming at stage 0."""

import pytest
import torch

from trainer_service.durable import DurableModels
from trainer_service.engine import AdamParams, DatumInput, TrainerEngine, effective_zero_stage
from trainer_service.lora import LoraSpec


def _adam(learning_rate, **overrides):
    return AdamParams(**{"learning_rate": learning_rate, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12,
                         "weight_decay": 0.0, "grad_clip_norm": 0.0, **overrides})


def _datum(tokens):
    return DatumInput(tokens[:-1], {"target_tokens": torch.tensor(tokens[1:]),
                                    "weights": torch.ones(len(tokens) - 1)})


A = _datum([5, 6, 7, 8, 9, 10, 11, 12])
B = _datum([20, 21, 22, 23, 24, 25])


def _adapter(engine, model_id):
    tensors, _ = engine.export_adapter(model_id)
    return tensors


@pytest.mark.parametrize("stage", [2, 3])
def test_two_calls_accumulate_like_one_and_tenants_stay_apart(tiny_model_dir, stage):
    engine = TrainerEngine(tiny_model_dir, zero_stage=stage)
    for model_id in ("split", "joint", "bystander"):
        engine.create_model(model_id, LoraSpec(rank=4, seed=0))
    untouched = _adapter(engine, "bystander")

    engine.forward_backward("split", [A], "cross_entropy", {}, forward_only=False)
    engine.forward_backward("bystander", [B], "cross_entropy", {}, forward_only=True)
    engine.forward_backward("split", [B], "cross_entropy", {}, forward_only=False)
    engine.forward_backward("joint", [A, B], "cross_entropy", {}, forward_only=False)
    adam = _adam(1e-2, weight_decay=0.01, grad_clip_norm=1.0)
    metrics = engine.optim_step("split", adam)
    engine.optim_step("joint", adam)
    assert metrics["step:max"] == 1.0 and metrics["grad_norm:mean"] > 0

    split, joint = _adapter(engine, "split"), _adapter(engine, "joint")
    assert max((split[k] - joint[k]).abs().max().item() for k in split) < 1e-5
    assert max((split[k] - untouched[k]).abs().max().item() for k in split) > 1e-3
    after = _adapter(engine, "bystander")
    assert all(torch.equal(after[k], untouched[k]) for k in after)


def test_bad_inputs_are_user_errors(tiny_model_dir):
    from tinkerd.errors import NotFoundError, UserError

    engine = TrainerEngine(tiny_model_dir, zero_stage=2)
    engine.create_model("m", LoraSpec(rank=2, seed=0))
    with pytest.raises(UserError, match="vocabulary"):
        engine.forward_backward("m", [_datum([1, 2, 10**7])], "cross_entropy", {}, forward_only=True)
    with pytest.raises(NotFoundError):
        engine.forward_backward("nope", [A], "cross_entropy", {}, forward_only=True)
    with pytest.raises(UserError, match="rank"):
        engine.create_model("big", LoraSpec(rank=10**4, seed=0))


def _logprobs(engine, model_id):
    outputs, _ = engine.forward_backward(model_id, [A, B], "cross_entropy", {}, forward_only=True)
    return torch.cat([o["logprobs"] for o in outputs])


@pytest.mark.parametrize("stage", [2, 3])
def test_unloaded_model_comes_back_with_its_optimizer_state(tiny_model_dir, tmp_path, stage):
    """A model unloaded mid-training and reloaded on next use trains on exactly like its twin
    that stayed in memory: same weights, same AdamW moments, same step count."""
    engine = TrainerEngine(tiny_model_dir, zero_stage=stage, durable=DurableModels(str(tmp_path)))
    adam = _adam(1e-2)
    for model_id in ("stays", "leaves"):
        engine.create_model(model_id, LoraSpec(rank=4, seed=1, train_unembed=False))
        engine.forward_backward(model_id, [A], "cross_entropy", {}, forward_only=False)
        engine.optim_step(model_id, adam)

    directory = engine.unload_model("leaves")
    assert not engine.is_resident("leaves")
    assert directory == str(tmp_path / "models" / "leaves" / "state")
    assert (tmp_path / "models" / "leaves" / "state" / "adapter_model.safetensors").exists()

    for model_id in ("stays", "leaves"):   # the second one reloads transparently
        engine.forward_backward(model_id, [B], "cross_entropy", {}, forward_only=False)
        metrics = engine.optim_step(model_id, adam)
        assert metrics["step:max"] == 2.0
    assert engine.is_resident("leaves")
    assert torch.allclose(_logprobs(engine, "stays"), _logprobs(engine, "leaves"), atol=1e-6)


def test_reloads_into_another_models_slot_train_on_exactly_like_the_twin(tiny_model_dir, tmp_path):
    """Unloaded models leave their adapter and engine as spare slots, and reloads take them over
    crosswise ("other" comes back into the slot "moving" left, and the reverse): every step's
    loss and the weights after it are bit for bit those of a twin that never left memory."""
    engine = TrainerEngine(tiny_model_dir, zero_stage=2, durable=DurableModels(str(tmp_path)))
    adam = _adam(1e-2)
    for model_id, seed in (("twin", 1), ("moving", 1), ("other", 2)):
        engine.create_model(model_id, LoraSpec(rank=4, seed=seed))
    for step in range(3):
        losses = {}
        for model_id in ("twin", "moving", "other"):
            outputs, _ = engine.forward_backward(model_id, [A, B], "cross_entropy", {}, forward_only=False)
            losses[model_id] = torch.cat([o["logprobs"] for o in outputs])
            engine.optim_step(model_id, adam)
        assert torch.equal(losses["twin"], losses["moving"]), f"step {step}"
        assert step == 0 or not torch.equal(losses["twin"], losses["other"])   # B starts at zero
        twin, moving = _adapter(engine, "twin"), _adapter(engine, "moving")
        assert all(torch.equal(twin[k], moving[k]) for k in twin)
        engine.unload_model("moving")
        engine.unload_model("other")
        engine.get("other")          # takes the slot "moving" left first
    engine.get("moving")
    # No adapter was built after the first three, and "moving" ended up in the slot "other" was made in.
    assert sorted(m.adapter_name for m in engine.models.all()) == ["m0", "m1", "m2"]
    assert engine.models.resident("moving").adapter_name == "m2"


def test_weights_only_checkpoint_starts_a_fresh_optimizer(tiny_model_dir, tmp_path):
    engine = TrainerEngine(tiny_model_dir, zero_stage=2)
    engine.create_model("src", LoraSpec(rank=4, seed=2))
    engine.forward_backward("src", [A], "cross_entropy", {}, forward_only=False)
    engine.optim_step("src", _adam(1e-2))
    engine.save_state("src", str(tmp_path / "w"), with_optimizer=False)
    copy = engine.load_state("copy", str(tmp_path / "w"), with_optimizer=False)
    assert copy.step == 0
    assert torch.allclose(_logprobs(engine, "src"), _logprobs(engine, "copy"), atol=1e-6)
    from tinkerd.errors import UserError
    with pytest.raises(UserError, match="weights only"):
        engine.load_state("again", str(tmp_path / "w"), with_optimizer=True)
    with pytest.raises(UserError, match="no checkpoint"):
        engine.load_state("none", str(tmp_path / "missing"), with_optimizer=False)


def test_32_models_over_one_base(tiny_model_dir):
    """32 tenants of different ranks and target modules train side by side on one base model."""
    engine = TrainerEngine(tiny_model_dir, zero_stage=2)
    specs = [LoraSpec(rank=(1, 4, 8, 16)[i % 4], seed=i, train_attn=i % 3 != 1, train_mlp=i % 3 != 2,
                      train_unembed=i % 2 == 0) for i in range(32)]
    before = {}
    for i, spec in enumerate(specs):
        engine.create_model(f"t{i}", spec)
        before[i] = _adapter(engine, f"t{i}")
    for i in range(0, 32, 2):    # every other tenant trains; the rest must not move
        engine.forward_backward(f"t{i}", [A], "cross_entropy", {}, forward_only=False)
        engine.optim_step(f"t{i}", _adam(1e-2))
    for i in range(32):
        after = _adapter(engine, f"t{i}")
        moved = any(not torch.equal(after[k], before[i][k]) for k in after)
        assert moved == (i % 2 == 0), i


class _Planted:
    """Unpickling this opens (creates) a file: what a planted optimizer file could do."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


# DeepSpeed's files that hold a model's optimizer state: stage 0 kept it with the module's (before
# adamw.safetensors, whose checkpoints still load); ZeRO in its partition.
_OPTIMIZER_FILES = {"stage 0, DeepSpeed's format": ("mp_rank_00_model_states.pt", "optimizer"),
                    "ZeRO-2, converted": ("zero_pp_rank_0_mp_rank_00_optim_states.pt", "optimizer_state_dict")}


def _as_deepspeed_wrote_stage_0(engine, model_id, directory):
    """The checkpoint at `directory` as a stage-0 trainer wrote it before adamw.safetensors:
    DeepSpeed's checkpoint of the engine (the adapter again beside the moments)."""
    from trainer_service import checkpoints

    model = engine.get(model_id)
    (directory / checkpoints.OPTIMIZER / checkpoints.ADAMW_STATE).unlink()
    model.engine.save_checkpoint(str(directory / checkpoints.OPTIMIZER), tag="state",
                                 client_state={"step": model.step}, save_latest=False)


@pytest.mark.parametrize("written", sorted(_OPTIMIZER_FILES))
def test_optimizer_state_loads_only_tensors(tiny_model_dir, tmp_path, written):
    """A full checkpoint of DeepSpeed's format restores through torch.load(weights_only=True); an
    optimizer file that pickles anything else is refused as a user error, and nothing in it runs.
    Both ways a one-rank trainer loads one: stage 0's own, and a ZeRO-2 one converted."""
    from tinkerd.errors import UserError

    stage_0 = written.startswith("stage 0")
    writer = TrainerEngine(tiny_model_dir, zero_stage=2, keep_zero_stage=not stage_0)
    writer.create_model("src", LoraSpec(rank=4, seed=3))
    writer.forward_backward("src", [A], "cross_entropy", {}, forward_only=False)
    writer.optim_step("src", _adam(1e-2))
    writer.save_state("src", str(tmp_path / "full"), with_optimizer=True)
    if stage_0:
        _as_deepspeed_wrote_stage_0(writer, "src", tmp_path / "full")
    engine = TrainerEngine(tiny_model_dir, zero_stage=2)
    assert engine.load_state("good", str(tmp_path / "full"), with_optimizer=True).step == 1
    name, key = _OPTIMIZER_FILES[written]
    marker = tmp_path / "code-ran"
    torch.save({key: _Planted(str(marker))}, tmp_path / "full" / "optimizer" / "state" / name)
    with pytest.raises(UserError, match="more than tensors"):
        engine.load_state("planted", str(tmp_path / "full"), with_optimizer=True)
    assert not marker.exists() and not engine.is_resident("planted")


@pytest.mark.parametrize("written", ["adamw.safetensors", "DeepSpeed's format"])
def test_stage_0_checkpoint_trains_on_like_the_original(tiny_model_dir, tmp_path, written):
    """A stage-0 trainer writes its AdamW state as adamw.safetensors, moments and step count only
    (no pickle, no second copy of the adapter); a model loaded from it, or from a stage-0
    checkpoint DeepSpeed wrote before, takes the original's next steps exactly."""
    from trainer_service import checkpoints

    adam = _adam(1e-2, weight_decay=0.01, grad_clip_norm=1.0)
    writer = TrainerEngine(tiny_model_dir, zero_stage=2)
    writer.create_model("m", LoraSpec(rank=4, seed=8))
    _train(writer, "m", adam, 2)
    writer.save_state("m", str(tmp_path / "ckpt"), with_optimizer=True)
    optimizer_dir = tmp_path / "ckpt" / checkpoints.OPTIMIZER
    assert sorted(p.name for p in optimizer_dir.iterdir()) == [checkpoints.ADAMW_STATE]
    adapter_bytes = (tmp_path / "ckpt" / checkpoints.ADAPTER_WEIGHTS).stat().st_size
    assert (optimizer_dir / checkpoints.ADAMW_STATE).stat().st_size < 2.2 * adapter_bytes     # two moments
    if written != "adamw.safetensors":
        _as_deepspeed_wrote_stage_0(writer, "m", tmp_path / "ckpt")
    reader = TrainerEngine(tiny_model_dir, zero_stage=2)
    assert reader.load_state("copy", str(tmp_path / "ckpt"), with_optimizer=True).step == 2
    assert _train(reader, "copy", adam, 2) == pytest.approx(_train(writer, "m", adam, 2), rel=1e-6)
    assert _max_difference(_adapter(reader, "copy"), _adapter(writer, "m")) < 1e-6


def test_stage_0_optimizer_state_that_does_not_fit_is_refused(tiny_model_dir, tmp_path):
    """adamw.safetensors of another adapter's shapes, or damaged, is the user's error with the
    reason, and leaves no half-made model behind."""
    import shutil

    from tinkerd.errors import UserError
    from trainer_service import checkpoints

    engine = TrainerEngine(tiny_model_dir, zero_stage=2)
    for model_id, rank in (("r4", 4), ("r8", 8)):
        engine.create_model(model_id, LoraSpec(rank=rank, seed=0))
        _train(engine, model_id, _adam(1e-2), 1)
        engine.save_state(model_id, str(tmp_path / model_id), with_optimizer=True)
    state = f"{checkpoints.OPTIMIZER}/{checkpoints.ADAMW_STATE}"
    shutil.copy(tmp_path / "r8" / state, tmp_path / "r4" / state)
    with pytest.raises(UserError, match="does not fit this adapter"):
        engine.load_state("mixed", str(tmp_path / "r4"), with_optimizer=True)
    (tmp_path / "r8" / state).write_bytes((tmp_path / "r8" / state).read_bytes()[:1000])
    with pytest.raises(UserError, match="unreadable"):
        engine.load_state("damaged", str(tmp_path / "r8"), with_optimizer=True)
    assert not engine.is_resident("mixed") and not engine.is_resident("damaged")
    engine.load_state("weights", str(tmp_path / "r8"), with_optimizer=False)        # its weights are fine
    assert _max_difference(_adapter(engine, "weights"), _adapter(engine, "r8")) == 0


# ---- ZeRO-1/2 on one rank run as stage 0 ------------------------------------------------------

@pytest.mark.parametrize("configured, world, runs", [(0, 1, 0), (1, 1, 0), (2, 1, 0), (3, 1, 3),
                                                      (0, 2, 0), (1, 2, 1), (2, 4, 2), (3, 2, 3)])
def test_one_rank_runs_zero_1_and_2_as_stage_0(configured, world, runs):
    assert effective_zero_stage(configured, world) == runs


def _train(engine, model_id, adam, steps):
    """`steps` optim steps of A then [A, B] in two calls; the grad norms they report."""
    norms = []
    for _ in range(steps):
        engine.forward_backward(model_id, [A], "cross_entropy", {}, forward_only=False)
        engine.forward_backward(model_id, [A, B], "cross_entropy", {}, forward_only=False)
        norms.append(engine.optim_step(model_id, adam)["grad_norm:mean"])
    return norms


def _max_difference(one, other):
    return max((one[k] - other[k]).abs().max().item() for k in one)


@pytest.mark.parametrize("clip", [0.5, 0.0])
def test_stage_0_trains_what_zero_2_does(tiny_model_dir, clip):
    """On one rank the stage-0 path (no closing micro-step, clipping and the norm taken here)
    takes ZeRO-2's steps: the same weights and the same grad_norm metric, with clipping (not at
    DeepSpeed's default of 1.0) and without."""
    fast = TrainerEngine(tiny_model_dir, zero_stage=2)
    zero2 = TrainerEngine(tiny_model_dir, zero_stage=2, keep_zero_stage=True)
    assert (fast.zero_stage, zero2.zero_stage) == (0, 2)
    adam = _adam(1e-2, weight_decay=0.01, grad_clip_norm=clip)
    for engine in (fast, zero2):
        engine.create_model("m", LoraSpec(rank=4, seed=5))
    norms = {id(engine): _train(engine, "m", adam, 3) for engine in (fast, zero2)}
    assert min(norms[id(zero2)]) > 1.0                    # every step clipped, where clipping is on
    assert norms[id(fast)] == pytest.approx(norms[id(zero2)], rel=1e-5)
    assert _max_difference(_adapter(fast, "m"), _adapter(zero2, "m")) < 1e-5


def test_stage_0_steps_without_deepspeed_bookkeeping(tiny_model_dir, monkeypatch):
    """At stage 0 a step runs no DeepSpeed forward, backward or step, nor the forward prologue
    DeepSpeed hooks onto the module it wraps (timers and counters only there: ~0.5 ms a tiny
    step); ZeRO-2 kept on one rank runs them all, which shows the count works."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    calls, names = {}, ("forward", "backward", "step", "_forward_prologue")
    for name in names:
        def counted(self, *args, _name=name, _original=getattr(DeepSpeedEngine, name), **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(DeepSpeedEngine, name, counted)
    for keep in (False, True):
        engine = TrainerEngine(tiny_model_dir, zero_stage=2, keep_zero_stage=keep)
        engine.create_model("m", LoraSpec(rank=4, seed=5))
        calls.clear()
        before = engine.forward_backward("m", [A, B], "cross_entropy", {}, forward_only=False)[1]["loss:sum"]
        engine.optim_step("m", _adam(1e-2))
        in_step = dict(calls)
        after = engine.forward_backward("m", [A, B], "cross_entropy", {}, forward_only=True)[1]["loss:sum"]
        assert after < before, (keep, before, after)
        if keep:
            assert set(in_step) == set(names) and in_step["step"] == 1, in_step
        else:
            assert in_step == {}, in_step


def test_stage_0_clips_gradients(tiny_model_dir):
    """With eps 1 a first AdamW step moves each weight by lr * g / (|g| + 1), less than lr * |g|:
    clipped to 1e-3, the whole move is at most lr * 1e-3; unclipped it is far larger."""
    engine = TrainerEngine(tiny_model_dir, zero_stage=0)
    moves, norms = {}, {}
    for clip in (0.0, 1e-3):
        model_id = f"clip-{clip}"
        engine.create_model(model_id, LoraSpec(rank=4, seed=6))
        before = _adapter(engine, model_id)
        norms[clip] = _train(engine, model_id, _adam(1.0, eps=1.0, grad_clip_norm=clip), 1)[0]
        after = _adapter(engine, model_id)
        moves[clip] = sum(((after[k] - before[k]) ** 2).sum().item() for k in after) ** 0.5
    assert norms[0.0] == pytest.approx(norms[1e-3], rel=1e-6) and norms[0.0] > 1.0   # reported before clipping
    assert moves[1e-3] <= 1e-3 * (1 + 1e-4)
    assert moves[0.0] > 100 * moves[1e-3]


@pytest.mark.parametrize("how", ["checkpoint", "restart"])
def test_one_rank_zero_2_optimizer_state_resumes_at_stage_0(tiny_model_dir, tmp_path, how):
    """A model trained 2 steps by a one-rank ZeRO-2 trainer (as trainers ran before stage 0),
    saved with its optimizer (a checkpoint, or its durable state before a restart) and loaded by
    today's one-rank trainer, trains 2 more steps exactly like the original: its AdamW moments and
    step count were converted. A model saved before its first step comes back fresh."""
    adam = _adam(1e-2, weight_decay=0.01, grad_clip_norm=1.0)
    writer = TrainerEngine(tiny_model_dir, zero_stage=2, keep_zero_stage=True, durable=DurableModels(str(tmp_path)))
    for model_id in ("m", "fresh"):
        writer.create_model(model_id, LoraSpec(rank=4, seed=7))
    _train(writer, "m", adam, 2)
    reader = TrainerEngine(tiny_model_dir, zero_stage=2, durable=DurableModels(str(tmp_path)))
    if how == "checkpoint":
        writer.save_state("m", str(tmp_path / "ckpt"), with_optimizer=True)
        resumed = reader.load_state("copy", str(tmp_path / "ckpt"), with_optimizer=True).model_id
    else:
        writer.unload_model("m")
        writer.get("m")             # the writer's twin: reloaded under ZeRO-2 itself
        resumed = "m"
    assert reader.get(resumed).step == 2 and reader.get("fresh").step == 0
    assert _train(reader, resumed, adam, 2) == pytest.approx(_train(writer, "m", adam, 2), rel=1e-6)
    assert _max_difference(_adapter(reader, resumed), _adapter(writer, "m")) < 1e-6
    assert _train(reader, "fresh", adam, 1) == pytest.approx(_train(writer, "fresh", adam, 1), rel=1e-6)


def _host_waits(call) -> int:
    """How often `call` makes the host wait for the GPU (torch's sync debug mode warns at each)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: host waits are a GPU's cost")
def test_a_step_reads_the_gpu_once_per_request(tiny_model_dir):
    """forward_backward's inputs go to the GPU without the host waiting (pinned, queued before the
    forward), and optim_step skips a non-finite step on the device: the host waits once per
    request, for what it answers (the outputs; the grad norm), never mid-step with the GPU idle."""
    engine = TrainerEngine(tiny_model_dir, zero_stage=2)
    assert engine.device.type == "cuda"
    engine.create_model("m", LoraSpec(rank=4, seed=0))
    batch = [_datum([5, 6, 7, 8, 9, 10]), _datum([20, 21, 22, 23, 24, 25])]      # equal lengths: no mask
    engine.forward_backward("m", batch, "cross_entropy", {}, forward_only=False)    # warm-up (allocations)
    engine.optim_step("m", _adam(1e-3))
    assert _host_waits(lambda: engine.forward_backward("m", batch, "cross_entropy", {}, forward_only=False)) == 1
    assert _host_waits(lambda: engine.optim_step("m", _adam(1e-3, grad_clip_norm=1.0))) == 1
