"""bench/trainer_only.py measures like with like: the plain PyTorch + PEFT loop and tinkerd's
TrainerEngine take the same steps on the same model, batch and LoRA init. (Here, not in
tests/bench/: it runs DeepSpeed in the pytest process, like the other tests of this folder.)"""

import inspect
import os
import subprocess
import sys
import warnings

import pytest
import torch

from bench.trainer_only import Setup, measure


def test_every_row_is_timed_and_plain_and_engine_take_the_same_steps():
    setup = Setup(device="cpu", shape="tiny", dtype="float32", batch=2, length=16, rank=4, steps=2, warmup=0,
                  tenants=2)
    report = measure(setup)
    rows = {r.name: r for r in report.rows}
    assert list(rows) == ["plain", "deepspeed", "engine", "engine alone", "engine, 1 more resident",
                          "engine, round-robin over 2"]
    assert all(r.ms > 0 and r.tokens_per_s > 0 and len(r.losses) == 2 for r in rows.values())
    assert report.step_flop > 0 and report.bound_ms > 0
    # Same init, same AdamW: the same loss at every step, not just the first (B starts at zero).
    assert rows["plain"].losses == pytest.approx(rows["engine"].losses, abs=1e-4)
    assert rows["deepspeed"].losses[0] == pytest.approx(rows["plain"].losses[0], abs=1e-4)
    assert {q["name"] for q in report.ratios} >= {"plain / engine", "plain / deepspeed",
                                                  "alone / (engine, round-robin over 2)"}


def test_rollouts_sharing_prompts_train_alike_packed_or_padded():
    """--group: the engine packs rollouts of one prompt as token trees; the padded engine, plain
    PyTorch and it take the same steps (the same losses)."""
    setup = Setup(device="cpu", shape="tiny", dtype="float32", batch=8, length=24, rank=4, steps=2, warmup=0,
                  skip_raw=True, group=4, prompt=16)
    rows = {r.name: r for r in measure(setup).rows}
    assert list(rows) == ["plain", "engine", "engine, padded"]
    assert rows["engine"].losses == pytest.approx(rows["plain"].losses, abs=1e-4)
    assert rows["engine, padded"].losses == pytest.approx(rows["engine"].losses, abs=1e-4)


@pytest.mark.parametrize("host_cores", [0, pytest.param(1, marks=pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="--host-cores needs a core to compute and one to serve"))])
def test_the_sdk_rows_go_through_the_services_and_train_as_the_engine_does(host_cores):
    """--sdk: the unmodified SDK, in a client process of its own, against `tinkerd trainer` +
    `tinkerd gateway` started on the bench's model (no sampler: a GPU host without vLLM runs it),
    one step at a time and 4 at once; the first step's loss is the in-process engine's, and the
    ratios against plain are reported. Each row says the CPU its processes spent and the floor
    that puts under it: on shared cores, their sum over the cores; with --host-cores 1, as a GPU
    host splits its work (the trainer and the in-process rows compute on the other cores, the
    client and the gateway serve on the last), the busier side's."""
    setup = Setup(device="cpu", shape="tiny", dtype="float32", batch=2, length=16, rank=4, steps=2, warmup=0,
                  skip_raw=True, sdk=True, host_cores=host_cores)
    report = measure(setup)
    rows = {r.name: r for r in report.rows}
    assert list(rows) == ["plain", "engine", "sdk", "sdk, 4 at once"]
    assert rows["sdk"].ms > 0 and rows["sdk, 4 at once"].ms > 0
    assert rows["sdk"].losses[0] == pytest.approx(rows["engine"].losses[0], abs=1e-5)
    assert {q["name"] for q in report.ratios} >= {"plain / sdk", "sdk / (sdk, 4 at once)"}

    cores = sorted(os.sched_getaffinity(0))         # given back by measure()
    if host_cores:
        assert report.placement.startswith(f"compute on cores {','.join(map(str, cores[:-1]))} (")
        assert report.placement.endswith(f"SDK client and gateway on {cores[-1]}")
    else:
        assert report.placement == f"every process on all {len(cores)} cores"
    assert set(report.cpu_ms) == set(rows)
    assert set(report.cpu_ms["plain"]) == {"bench"}
    for name in ("sdk", "sdk, 4 at once"):
        spent = report.cpu_ms[name]
        assert set(spent) == {"client", "gateway", "trainer"} and all(ms > 0 for ms in spent.values()), spent
        # Split: the busier side, the trainer over the compute cores or the serving pair over one core.
        floor = (max(spent["trainer"] / (len(cores) - 1), spent["client"] + spent["gateway"]) if host_cores
                 else sum(spent.values()) / len(cores))
        assert report.cpu_floor_ms[name] == pytest.approx(floor)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="--host-cores needs a core to compute and one to serve")
def test_a_split_host_starts_each_side_on_its_own_cores_and_gives_this_process_back():
    import torch

    from bench.host_cores import Split

    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    split = Split.of(1)
    assert split.host == (max(cores),) and set(split.compute) == cores - {max(cores)}
    show = [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]
    for side in ("compute", "host"):
        out = subprocess.run(split.command(side, show), capture_output=True, text=True, check=True).stdout
        assert out.strip() == str(sorted(getattr(split, side)))
    with split.computing_here():
        assert os.sched_getaffinity(0) == set(split.compute) and torch.get_num_threads() == len(split.compute)
    assert os.sched_getaffinity(0) == cores and torch.get_num_threads() == threads
    with pytest.raises(ValueError, match="--host-cores 0: this process may use"):
        Split.of(0)
    with pytest.raises(ValueError, match="give the compute at least one"):
        Split.of(len(cores))


def test_the_cpu_meter_reads_a_process_s_cpu_to_the_millisecond():
    """Per-process CPU clocks (not /proc's 10 ms ticks): a 30 ms busy loop in a child reads as
    30 ms (and a little for its pipe), and this process's waiting for it as nothing."""
    from bench.host_cores import CpuMeter

    child = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                              "for line in sys.stdin:\n"
                              "    end = time.thread_time() + 0.03\n"
                              "    while time.thread_time() < end: pass\n"
                              "    print('done', flush=True)"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        meter = CpuMeter({"child": child.pid, "here": os.getpid()})

        def busy_there():
            child.stdin.write("go\n")
            child.stdin.flush()
            assert child.stdout.readline() == "done\n"
        step = meter.wrap(busy_there)
        for _ in range(5):
            step()
        spent = meter.ms_per_step()
        assert 29 <= spent["child"] <= 40, spent
        assert spent["here"] < 10, spent
    finally:
        child.kill()
        child.wait()


@pytest.mark.tcmalloc
def test_the_command_measures_under_the_trainer_s_allocator():
    """`python -m bench.trainer_only` re-executes itself under tcmalloc, as `tinkerd trainer` does,
    so plain PyTorch and the engine are timed under the allocator the service runs."""
    out = subprocess.run([sys.executable, "-m", "bench.trainer_only", "--device", "cpu", "--shape", "tiny",
                          "--batch", "2", "--length", "16", "--rank", "4", "--steps", "1", "--warmup", "0",
                          "--skip-raw"], capture_output=True, text=True, timeout=600,
                         env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"})
    assert out.returncode == 0, out.stderr[-3000:]
    header = next(line for line in out.stdout.splitlines() if line.startswith("trainer_only: tiny"))
    assert header.endswith(", tcmalloc)"), header


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the bench's bf16 rows on a GPU")
def test_engine_trains_in_bf16_on_cuda_and_starts_where_plain_does():
    setup = Setup(device="cuda", shape="tiny", dtype="bfloat16", batch=4, length=64, rank=8, steps=6, warmup=0,
                  learning_rate=1e-2, skip_raw=True)
    rows = {r.name: r for r in measure(setup).rows}
    engine, plain = rows["engine"].losses, rows["plain"].losses
    assert engine[-1] < engine[0] - 0.05, engine      # the same batch again and again: it must fit it
    # bf16 weights and logits; the engine passes an attention mask, plain does not: other kernels may run.
    assert engine[0] == pytest.approx(plain[0], abs=2e-2)



def _synchronizing_call():
    warnings.warn("called a synchronizing CUDA operation")      # as torch's sync debug mode warns


def test_the_profile_names_where_a_step_synchronizes():
    """--profile on a GPU lists the lines where a step waits for the device, each named by the
    innermost frame of the project's own code (not the bench's), counted; other warnings ignored."""
    from bench.trainer_only import Timed, synchronizations

    def step():
        for _ in range(2):
            _synchronizing_call()
        warnings.warn("something else")
        return torch.zeros(())

    line = inspect.getsourcelines(_synchronizing_call)[1] + 1
    assert synchronizations(Timed(step, 1, cuda=False)) == [
        (f"tests/trainer/test_trainer_only_bench.py:{line} (_synchronizing_call)", 2)]
