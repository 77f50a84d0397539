"""The trainer as one job of W ranks under torchrun (trainer_service/ranks.py), on real DeepSpeed
over gloo: W=2 computes what W=1 does, for every loss, under ZeRO-2 and ZeRO-3 (one rank runs
ZeRO-2 as stage 0), and at stage 0 (whose optim_step all-reduces the gradients itself)."""

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOLERANCE = 1e-5


def run_job(world: int, *argv: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """A torchrun job of `world` ranks on this host, outside any launcher's environment."""
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(world), *argv], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def torchrun(world: int, *argv: str, timeout: float = 600) -> None:
    done = run_job(world, *argv, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


def job(tiny_model_dir: str, tmp_path, world: int, stage: int) -> dict[str, torch.Tensor]:
    state, out = tmp_path / f"state-{world}", tmp_path / f"out-{world}.pt"
    state.mkdir()
    torchrun(world, os.path.join(ROOT, "tests", "trainer", "ranks_job.py"), tiny_model_dir, str(stage),
             str(state), str(out))
    return torch.load(out, weights_only=True)


_ONE_RANK: dict[int, dict[str, torch.Tensor]] = {}


def one_rank(tiny_model_dir: str, tmp_path, stage: int) -> dict[str, torch.Tensor]:
    """The W=1 reference, computed in this process (a one-rank engine, as test_engine.py runs):
    a torchrun job of one rank adds only its imports. Stages 0 and 2 are one computation on one
    rank (ZeRO-2 partitions nothing there and runs as stage 0), so they share it."""
    from ranks_job import results
    from trainer_service.deepspeed_setup import effective_zero_stage
    from trainer_service.durable import DurableModels
    from trainer_service.engine import TrainerEngine

    stage = effective_zero_stage(stage, 1)
    if stage not in _ONE_RANK:
        state = tmp_path / "state-1"
        state.mkdir()
        engine = TrainerEngine(tiny_model_dir, zero_stage=stage, durable=DurableModels(str(state)))
        _ONE_RANK[stage] = results(engine, str(state))
    return {k: v.clone() for k, v in _ONE_RANK[stage].items()}


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_two_ranks_compute_what_one_does(tiny_model_dir, tmp_path, stage):
    """Per-datum logprobs and losses, loss sums and gradient norms of every call, and the adapter
    after three optim steps (one of them from two calls, one of those a single datum, which
    leaves a rank without data), for every loss: W=2 equals W=1 within 1e-5 (fp32), W=2 in
    micro-batches (2 on one rank, 3 on the other: ranks_job.py), W=1 in one pass. Then a full
    checkpoint loaded into a copy, the copy unloaded and reloaded on its next use: it trains on
    exactly like the original, on 2 ranks as on 1."""
    one, two = one_rank(tiny_model_dir, tmp_path, stage), job(tiny_model_dir, tmp_path, 2, stage)
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


# ---- `tinkerd trainer` as a 2-rank job, over real gRPC ------------------------------------------

def _datum(shift: int = 0):
    import numpy as np

    from tinkerd import tensors
    from tinkerd.v1 import common_pb2
    tokens = [5 + shift + (7 * i) % 50 for i in range(12)]
    return common_pb2.Datum(tokens=tokens[:-1], loss_fn_inputs={
        "target_tokens": tensors.from_numpy(np.array(tokens[1:], dtype=np.int64)),
        "weights": tensors.from_numpy(np.ones(len(tokens) - 1, dtype=np.float32))})


@pytest.mark.parametrize("failing", ["0", "1"])
def test_a_call_failing_on_one_rank_breaks_the_job_at_once(tiny_model_dir, tmp_path, failing):
    """A forward_backward that fails inside the call on one rank only, while the other goes on
    into the call's collectives (gather_outputs' send and recv): the caller gets the job's
    failure within seconds and the job exits non-zero. Before, the failed rank waited to compare
    outcomes while the other waited in its send: the job hung for COMMAND_TIMEOUT (30 min)."""
    import time

    t0 = time.monotonic()
    done = run_job(2, os.path.join(ROOT, "tests", "trainer", "ranks_fault_job.py"), tiny_model_dir,
                   str(tmp_path / "state"), failing, timeout=150)
    took = time.monotonic() - t0
    caller = [line for line in done.stdout.splitlines() if line.startswith("CALLER")]
    assert caller and caller[0].startswith("CALLER UnavailableError"), done.stdout[-2000:] + done.stderr[-4000:]
    assert "trainer job" in caller[0], caller
    assert float(caller[0].split(" after ")[1].split(" s")[0]) < 20, caller
    assert done.returncode != 0 and took < 120, (done.returncode, took)


def _ranks_by_number(root_pid: int) -> dict[int, int]:
    """{rank: pid} of the workers torchrun started."""
    import psutil

    found = {}
    for child in psutil.Process(root_pid).children(recursive=True):
        env = child.environ()
        if "RANK" in env and "launcher.cli" in child.cmdline():
            found[int(env["RANK"])] = child.pid
    return found


@pytest.fixture
def two_rank_trainer(tiny_model_dir, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                                                            "LOCAL_RANK")}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "-m", "launcher.cli", "trainer", "--base-model", tiny_model_dir, "--listen",
                             "127.0.0.1:0", "--state-dir", str(tmp_path / "state"), "--zero-stage", "3", "--dtype", "float32"],
                            stdout=subprocess.PIPE, stderr=open(tmp_path / "trainer.log", "w"), text=True,
                            env={**env, "PYTHONPATH": ROOT}, cwd=ROOT)
    port = None
    for line in proc.stdout:
        if line.startswith("READY trainer"):
            port = int(line.split()[2])
            break
    if port is None:
        proc.wait(timeout=60)
        pytest.fail("the 2-rank trainer did not start:\n" + (tmp_path / "trainer.log").read_text()[-4000:])
    try:
        yield proc, f"127.0.0.1:{port}", tmp_path / "state"
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=60)


def test_a_two_rank_trainer_serves_and_fails_clearly_when_a_rank_dies(two_rank_trainer, tiny_model_dir):
    """`torchrun --nproc-per-node 2 -m launcher.cli trainer` (ZeRO-3): rank 0 serves gRPC. Train,
    save a full checkpoint, load it into a copy, unload the copy (it comes back on its next
    use, equal to the original), push a persisted snapshot; optimizer state from a 1-rank trainer
    is refused as the user's error, its weights load. Then rank 1 dies during a call: the
    call fails with a `server` error that says so, Health says not ready and grpc.health.v1
    NOT_SERVING (what the gateway, kubelet and `python -m tinkerd.health` ask), the job exits non-zero."""
    import signal
    import time

    import grpc
    import numpy as np

    from tinkerd import tensors
    from tinkerd.errors import category_for
    from tinkerd.rpc import ServiceAuth, channel
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tinkerd.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc

    proc, address, state = two_rank_trainer
    stub = trainer_pb2_grpc.TrainerStub(channel(address, ServiceAuth()))
    assert stub.Health(common_pb2.HealthRequest(), timeout=30).ready
    adam = common_pb2.AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8)
    stub.CreateModel(trainer_pb2.CreateModelRequest(model_id="s:train:0", lora_config=common_pb2.LoraConfig(
        rank=4, seed=3, train_attn=True, train_mlp=True)), timeout=120)
    fb = stub.ForwardBackward(trainer_pb2.ForwardBackwardRequest(
        model_id="s:train:0", seq_id=1, loss_fn="cross_entropy", data=[_datum(0), _datum(1), _datum(2)]), timeout=120)
    assert len(fb.outputs) == 3 and fb.metrics["loss:sum"] > 0
    stub.OptimStep(trainer_pb2.OptimStepRequest(model_id="s:train:0", seq_id=2, adam_params=adam), timeout=120)
    stub.SaveState(trainer_pb2.SaveStateRequest(model_id="s:train:0", seq_id=3, kind="weights", name="c",
                                                with_optimizer=True), timeout=120)
    stub.CreateModel(trainer_pb2.CreateModelRequest(model_id="s:train:1", load_optimizer=True,
                                                    load_checkpoint=trainer_pb2.CheckpointRef(
                                                        model_id="s:train:0", kind="weights", name="c")), timeout=120)
    stub.UnloadModel(trainer_pb2.UnloadModelRequest(model_id="s:train:1"), timeout=120)

    def logprobs(model_id, seq):
        reply = stub.ForwardBackward(trainer_pb2.ForwardBackwardRequest(
            model_id=model_id, seq_id=seq, loss_fn="cross_entropy", forward_only=True,
            data=[_datum(0), _datum(3)]), timeout=120)
        return np.concatenate([tensors.to_numpy(o.outputs["logprobs"]) for o in reply.outputs])
    np.testing.assert_allclose(logprobs("s:train:1", 1), logprobs("s:train:0", 4), atol=1e-6)
    pushed = stub.PushWeights(trainer_pb2.PushWeightsRequest(model_id="s:train:0", seq_id=5, snapshot_id="snap",
                                                             persist=True), timeout=120)
    assert os.path.exists(os.path.join(pushed.persisted_path, "adapter_model.safetensors"))

    # Optimizer state that a 1-rank trainer wrote is partitioned for 1 rank: refused as the
    # user's error (on every rank alike: the job stays healthy); its weights alone load.
    from tinkerd import paths
    from trainer_service.engine import TrainerEngine
    from trainer_service.lora import LoraSpec
    single = TrainerEngine(tiny_model_dir, zero_stage=3)
    single.create_model("w1", LoraSpec(rank=4, seed=3))
    single.save_state("w1", paths.checkpoint_dir(str(state), "w1:train:0", "weights", "c"), with_optimizer=True)
    ref = trainer_pb2.CheckpointRef(model_id="w1:train:0", kind="weights", name="c")
    with pytest.raises(grpc.RpcError) as refused:
        stub.CreateModel(trainer_pb2.CreateModelRequest(model_id="s:train:2", load_optimizer=True,
                                                        load_checkpoint=ref), timeout=120)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "1 ranks" in refused.value.details()
    stub.CreateModel(trainer_pb2.CreateModelRequest(model_id="s:train:2", load_checkpoint=ref), timeout=120)
    assert stub.Health(common_pb2.HealthRequest(), timeout=30).ready

    ranks = _ranks_by_number(proc.pid)
    assert sorted(ranks) == [0, 1]
    health = health_pb2_grpc.HealthStub(channel(address, ServiceAuth())).Watch(health_pb2.HealthCheckRequest(),
                                                                              timeout=120)
    assert next(health).status == health_pb2.HealthCheckResponse.SERVING
    os.kill(ranks[1], signal.SIGSTOP)          # rank 1 hangs; a call goes in; then rank 1 dies
    call = stub.ForwardBackward.future(trainer_pb2.ForwardBackwardRequest(
        model_id="s:train:0", seq_id=6, loss_fn="cross_entropy", data=[_datum(0), _datum(1)]), timeout=120)
    time.sleep(1.0)
    os.kill(ranks[1], signal.SIGKILL)
    with pytest.raises(grpc.RpcError) as failed:
        call.result()
    assert category_for(failed.value.code()) == "server", failed.value
    assert "trainer job" in failed.value.details(), failed.value.details()
    assert next(health).status == health_pb2.HealthCheckResponse.NOT_SERVING     # sent as the job broke
    try:
        assert not stub.Health(common_pb2.HealthRequest(), timeout=5).ready
    except grpc.RpcError as e:                 # rank 0 is exiting or gone: not ready either
        assert e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    assert proc.wait(timeout=60) != 0


def test_up_starts_the_trainer_as_a_torchrun_job_of_trainer_ranks():
    """`tinkerd up --trainer-ranks 2`: the trainer's command is torchrun with 2 ranks on this host
    around the same `tinkerd trainer` command line; 1 (the default) runs it as a plain process."""
    from launcher import cli, up

    args = cli.build_parser().parse_args(["up", "--base-model", "/m", "--trainer-ranks", "2", "--zero-stage", "3"])
    command = up.child_command(args, "trainer", listen="127.0.0.1:5000")
    assert command[:6] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m"]
    assert command[6:] == ["launcher.cli", *up.child_argv(args, "trainer", listen="127.0.0.1:5000")]
    assert "--zero-stage" in command and "--trainer-ranks" not in command
    assert up.child_command(args, "sampler")[:3] == [sys.executable, "-m", "launcher.cli"]
    single = cli.build_parser().parse_args(["up", "--base-model", "/m"])
    assert up.child_command(single, "trainer")[:4] == [sys.executable, "-m", "launcher.cli", "trainer"]
