"""A model's durable state (trainer_service/durable.py) at the servicer: a restarted trainer
(a new engine and servicer on the same state dir) brings every model back exactly, says once
what a crash lost, never applies a request twice, and evicts least recently used models."""

import os

import numpy as np
import pytest
import torch

from tinkerd import tensors
from tinkerd.v1 import common_pb2, trainer_pb2
from trainer_service import checkpoints
from trainer_service.durable import DurableModels
from trainer_service.engine import TrainerEngine
from trainer_service.servicer import TrainerServicer

from conftest import start_trainer_process
from servicer_context import Aborted, Context, answered

TOKENS = [5, 9, 17, 33, 2, 71, 8, 40, 12, 3]


def _trainer(model_dir, state_dir, **kwargs) -> TrainerServicer:
    """A trainer as `tinkerd trainer` makes one; a second on the same state dir is a restart."""
    interval = kwargs.pop("durable_interval_s", 0.0)
    idle = kwargs.pop("durable_idle_s", 1.0)
    engine = TrainerEngine(model_dir, zero_stage=2, durable=DurableModels(str(state_dir), interval), **kwargs)
    return TrainerServicer(engine, state_dir=str(state_dir), durable_idle_s=idle)


def _create(trainer, model_id):
    trainer.CreateModel(trainer_pb2.CreateModelRequest(model_id=model_id, lora_config=common_pb2.LoraConfig(
        rank=4, seed=3, train_attn=True, train_mlp=True)), Context())


def _datum(shift=0):
    tokens = [t + shift for t in TOKENS]
    return common_pb2.Datum(tokens=tokens[:-1], loss_fn_inputs={
        "target_tokens": tensors.from_numpy(np.array(tokens[1:], dtype=np.int64)),
        "weights": tensors.from_numpy(np.ones(len(tokens) - 1, dtype=np.float32))})


def _fb(trainer, model_id, seq, *, forward_only=False, shift=0):
    return trainer.ForwardBackward(trainer_pb2.ForwardBackwardRequest(
        model_id=model_id, seq_id=seq, loss_fn="cross_entropy", forward_only=forward_only,
        data=[_datum(shift)]), Context())


def _logprobs(trainer, model_id, seq):
    reply = _fb(trainer, model_id, seq, forward_only=True)
    return tensors.to_numpy(reply.outputs[0].outputs["logprobs"])


def _step(trainer, model_id, seq):
    return trainer.OptimStep(trainer_pb2.OptimStepRequest(
        model_id=model_id, seq_id=seq, adam_params=common_pb2.AdamParams(learning_rate=1e-2, beta1=0.9,
                                                                          beta2=0.95, eps=1e-8)), Context())


def test_a_restarted_trainer_brings_the_model_back_exactly(tiny_model_dir, tmp_path):
    """Same weights and same AdamW state after a restart: it trains on like a twin that stayed."""
    twin, first = _trainer(tiny_model_dir, tmp_path / "twin"), _trainer(tiny_model_dir, tmp_path / "a")
    for trainer in (twin, first):
        _create(trainer, "s:train:0")
        _fb(trainer, "s:train:0", 1)
        _step(trainer, "s:train:0", 2)
    restarted = _trainer(tiny_model_dir, tmp_path / "a")
    assert not restarted.engine.is_resident("s:train:0")
    np.testing.assert_allclose(_logprobs(restarted, "s:train:0", 3), _logprobs(twin, "s:train:0", 3), atol=1e-6)
    for trainer in (twin, restarted):
        _fb(trainer, "s:train:0", 4, shift=1)
        assert _step(trainer, "s:train:0", 5).metrics["step:max"] == 2.0
    np.testing.assert_allclose(_logprobs(restarted, "s:train:0", 6), _logprobs(twin, "s:train:0", 6), atol=1e-6)


def test_lost_work_is_told_once_and_nothing_is_applied_twice(tiny_model_dir, tmp_path):
    first = _trainer(tiny_model_dir, tmp_path)
    _create(first, "s:train:0")
    _fb(first, "s:train:0", 1)
    stepped = _step(first, "s:train:0", 2)
    before = _logprobs(first, "s:train:0", 3)
    _fb(first, "s:train:0", 4)                 # accumulated gradients: not in any durable state

    restarted = _trainer(tiny_model_dir, tmp_path)
    context = Context()
    with pytest.raises(Aborted):
        answered(restarted.ForwardBackward)(trainer_pb2.ForwardBackwardRequest(
            model_id="s:train:0", seq_id=5, loss_fn="cross_entropy", forward_only=True, data=[_datum()]), context)
    assert "resumed from its state at step 1 (seq_id 2)" in context.details()
    assert "forward_backward seq_id 4" in context.details()
    assert context.code().name == "ABORTED"          # Tinker category "server"
    # Said once: the next request runs, on the resumed state.
    np.testing.assert_allclose(_logprobs(restarted, "s:train:0", 6), before, atol=1e-6)

    # A resent optim_step the state includes gets its first reply and is not applied again.
    again = _step(restarted, "s:train:0", 2)
    assert again == stepped and restarted.engine.get("s:train:0").step == 1
    # A resent forward_backward the state includes is refused, not applied twice.
    context = Context()
    with pytest.raises(Aborted):
        answered(restarted.ForwardBackward)(trainer_pb2.ForwardBackwardRequest(
            model_id="s:train:0", seq_id=1, loss_fn="cross_entropy", data=[_datum()]), context)
    assert "applied before the trainer restarted" in context.details()
    np.testing.assert_allclose(_logprobs(restarted, "s:train:0", 7), before, atol=1e-6)


def test_idle_trainer_writes_what_is_behind(tiny_model_dir, tmp_path):
    """With a long interval nothing is written at the step, but an idle second later it is."""
    import time

    first = _trainer(tiny_model_dir, tmp_path, durable_interval_s=1e9)
    _create(first, "s:train:0")
    _fb(first, "s:train:0", 1)
    _step(first, "s:train:0", 2)
    assert first.engine.behind() == ["s:train:0"]
    deadline = time.monotonic() + 30
    while first.engine.behind():
        assert time.monotonic() < deadline, "the idle writer never wrote the model"
        time.sleep(0.2)
    restarted = _trainer(tiny_model_dir, tmp_path)
    np.testing.assert_allclose(_logprobs(restarted, "s:train:0", 3), _logprobs(first, "s:train:0", 3), atol=1e-6)


def test_with_durable_idle_s_0_an_idle_trainer_writes_nothing_until_the_interval(tiny_model_dir, tmp_path):
    """--durable-idle-s 0 (a benchmark's reference must not share the cores with our write): an idle
    trainer leaves the model behind; the next optim_step past --durable-interval-s writes it."""
    import time

    trainer = _trainer(tiny_model_dir, tmp_path, durable_interval_s=2.0, durable_idle_s=0)
    _create(trainer, "s:train:0")
    _fb(trainer, "s:train:0", 1)
    _step(trainer, "s:train:0", 2)
    time.sleep(2.5)                                   # idle, and past the interval
    assert trainer.engine.behind() == ["s:train:0"]
    _fb(trainer, "s:train:0", 3)
    _step(trainer, "s:train:0", 4)
    _wait_written(trainer)


def _wait_written(trainer) -> None:
    """Until the trainer holds no model whose durable state is behind (an interval write follows
    the optim_step's reply)."""
    import time

    deadline = time.monotonic() + 30
    while trainer.engine.behind():
        assert time.monotonic() < deadline, f"never written: {trainer.engine.behind()}"
        time.sleep(0.05)


def test_an_interval_write_follows_the_optim_step_reply(tiny_model_dir, tmp_path):
    """With --durable-interval-s above 0 the state may lag by the interval anyway, so the write an
    optim_step makes due runs after its reply, and the caller (an RL loop about to sample) does not
    wait for it. Here the write is held back: the reply comes all the same, and once the write is
    let go the state on disk is the model's."""
    import threading
    import time

    trainer = _trainer(tiny_model_dir, tmp_path, durable_interval_s=0.01, durable_idle_s=0)
    _create(trainer, "s:train:0")
    release, write = threading.Event(), trainer.engine.save_durable

    def held(model_id):
        release.wait(60)
        write(model_id)
    trainer.engine.save_durable = held
    _fb(trainer, "s:train:0", 1)
    time.sleep(0.05)                                  # past the interval
    _step(trainer, "s:train:0", 2)                    # answered with its write still held
    assert trainer.engine.behind() == ["s:train:0"]
    release.set()
    _wait_written(trainer)
    restarted = _trainer(tiny_model_dir, tmp_path)
    np.testing.assert_allclose(_logprobs(restarted, "s:train:0", 3), _logprobs(trainer, "s:train:0", 3), atol=1e-6)


def test_least_recently_used_models_wait_on_disk(tiny_model_dir, tmp_path):
    trainer = _trainer(tiny_model_dir, tmp_path, max_resident=2)
    for n in range(3):
        _create(trainer, f"s:train:{n}")
        _fb(trainer, f"s:train:{n}", 1, shift=n)
        _step(trainer, f"s:train:{n}", 2)
    before = _logprobs(trainer, "s:train:2", 3)
    resident = [n for n in range(3) if trainer.engine.is_resident(f"s:train:{n}")]
    assert len(resident) == 2 and 0 not in resident
    _logprobs(trainer, "s:train:0", 3)          # comes back; the least recently used one leaves
    assert trainer.engine.is_resident("s:train:0") and not trainer.engine.is_resident("s:train:1")
    np.testing.assert_allclose(_logprobs(trainer, "s:train:2", 4), before, atol=1e-6)
    assert trainer.DeleteModel(trainer_pb2.DeleteModelRequest(model_id="s:train:1"), Context()).deleted
    assert not os.path.exists(tmp_path / "models" / "s_train_1")


def test_a_crash_mid_swap_leaves_the_old_checkpoint(tmp_path):
    """commit_state renames the old one aside before the new one goes in; a crash between the
    two renames leaves only the aside copy, which the next read puts back."""
    directory = tmp_path / "ckpt"
    (tmp_path / "ckpt.old-123").mkdir()
    (tmp_path / "ckpt.old-123" / "tinkerd_state.json").write_text("{}")
    checkpoints.recover_swap(str(directory))
    assert (directory / "tinkerd_state.json").exists() and not (tmp_path / "ckpt.old-123").exists()
    new = tmp_path / "new"
    new.mkdir()
    (new / "x").write_text("new")
    checkpoints.commit_state(str(new), str(directory))
    assert sorted(os.listdir(tmp_path)) == ["ckpt"] and (directory / "x").read_text() == "new"


def test_a_trainer_stopped_by_sigterm_writes_what_is_behind_first(tiny_model_dir, tmp_path):
    """A clean stop (SIGTERM from `tinkerd up`, Kubernetes, systemd) loses no step: a real `tinkerd
    trainer` whose interval and idle writes never come stops, and a trainer started on its state dir
    goes on from the last step without saying that anything was lost."""
    import signal

    from tinkerd.rpc import ServiceAuth, channel
    from tinkerd.v1 import trainer_pb2_grpc

    proc, port = start_trainer_process(tiny_model_dir, str(tmp_path), "--dtype", "float32",
                                       "--durable-interval-s", "3600", "--durable-idle-s", "0")
    try:
        first = trainer_pb2_grpc.TrainerStub(channel(f"127.0.0.1:{port}", ServiceAuth()))
        first.CreateModel(trainer_pb2.CreateModelRequest(model_id="s:train:0", lora_config=common_pb2.LoraConfig(
            rank=4, seed=3, train_attn=True, train_mlp=True)), timeout=60)
        for seq in (1, 3):
            first.ForwardBackward(trainer_pb2.ForwardBackwardRequest(
                model_id="s:train:0", seq_id=seq, loss_fn="cross_entropy", data=[_datum()]), timeout=60)
            first.OptimStep(trainer_pb2.OptimStepRequest(model_id="s:train:0", seq_id=seq + 1, adam_params=(
                common_pb2.AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8))), timeout=60)
        before = tensors.to_numpy(first.ForwardBackward(trainer_pb2.ForwardBackwardRequest(
            model_id="s:train:0", seq_id=5, loss_fn="cross_entropy", forward_only=True, data=[_datum()]),
            timeout=60).outputs[0].outputs["logprobs"])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    restarted = _trainer(tiny_model_dir, tmp_path)
    np.testing.assert_allclose(_logprobs(restarted, "s:train:0", 6), before, atol=1e-6)   # no step lost
    _fb(restarted, "s:train:0", 7)
    assert _step(restarted, "s:train:0", 8).metrics["step:max"] == 3.0


def test_a_write_that_fails_leaves_the_last_state_and_nothing_half_written(tiny_model_dir, tmp_path, monkeypatch):
    """A durable write that fails part way (the disk full while the optimizer state goes out)
    leaves the model's last durable state as it was and no partial directory beside it (a trainer
    retrying on a full disk would otherwise fill it further); once there is room, it is written."""
    from trainer_service.lora import LoraSpec
    from trainer_service.training import AdamParams, DatumInput

    engine = TrainerEngine(tiny_model_dir, zero_stage=2, durable=DurableModels(str(tmp_path)))
    engine.create_model("m", LoraSpec(rank=4, seed=3))          # its durable state: step 0
    datum = DatumInput(TOKENS[:-1], {"target_tokens": torch.tensor(TOKENS[1:]), "weights": torch.ones(len(TOKENS) - 1)})
    engine.forward_backward("m", [datum], "cross_entropy", {}, forward_only=False)
    engine.optim_step("m", AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0,
                                      grad_clip_norm=0.0))
    state = engine.durable.state_path("m")
    beside = os.path.dirname(state)
    before = sorted(os.listdir(beside)), sorted(os.listdir(state))

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(checkpoints, "_write_moments", disk_full)
    with pytest.raises(OSError, match="No space"):
        engine.save_durable("m")
    assert (sorted(os.listdir(beside)), sorted(os.listdir(state))) == before
    assert checkpoints.read_state(state, with_optimizer=True, zero_stage=0)[2] == 0
    monkeypatch.undo()
    engine.save_durable("m")
    assert checkpoints.read_state(state, with_optimizer=True, zero_stage=0)[2] == 1
    assert sorted(os.listdir(beside)) == before[0]
