"""The host's core board (tinkerd/cores.py) across real processes: who counts as busy, what a
process that dies while busy leaves behind, the threads a computing thread gets, and the
trainer engine following the board layer by layer, forward and backward."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from tinkerd import cores
from tinkerd.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Another process on the board: "busy"/"idle" lines on stdin mark it, it answers "ok".
OTHER = textwrap.dedent("""
    import sys
    from tinkerd.cores import Board
    board = Board(sys.argv[1], cores=4, lease_s=float(sys.argv[2]))
    print("slot", board.slot, flush=True)
    for line in sys.stdin:
        board.busy() if line.strip() == "busy" else board.idle()
        print("ok", flush=True)
""")


class Other:
    def __init__(self, path: str, lease_s: float = 60.0):
        self.proc = subprocess.Popen([sys.executable, "-c", OTHER, path, str(lease_s)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=ROOT,
                                     env={**os.environ, "PYTHONPATH": ROOT})
        self.slot = int(self.proc.stdout.readline().split()[1])

    def say(self, word: str) -> None:
        self.proc.stdin.write(word + "\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "ok"

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def test_busy_processes_divide_the_cores_and_a_dead_ones_lease_runs_out(tmp_path):
    path = str(tmp_path / "board")
    me = cores.Board(path, cores=4)
    assert me.busy() == 4 and me.count_busy() == 1            # alone: every core
    other = Other(path, lease_s=1.0)
    try:
        assert other.slot != me.slot
        other.say("busy")
        assert me.busy() == 2 and me.count_busy() == 2        # side by side: half each
        other.say("idle")
        assert me.busy() == 4
        me.idle()
        assert me.count_busy() == 0
        other.say("busy")
        slot = other.slot
    finally:
        other.kill()                                          # dies busy: counts until its lease ends
    assert me.count_busy() == 1
    time.sleep(1.1)
    assert me.count_busy() == 0 and me.busy() == 4
    successor = Other(path)                                   # the dead process's lock went with it
    try:
        assert successor.slot == slot
        assert me.count_busy() == 1                           # the slot was cleared, then I am busy
    finally:
        successor.kill()


def test_a_computing_thread_gets_the_threads_the_board_gives(tmp_path):
    """In a process of its own (OpenMP's thread count is process state): alone on 2 cores the
    computing thread runs 2 threads; with another busy process, 1; a nested block leaves the
    outer one busy; outside `computing`, ticks change nothing; one thread going idle leaves the
    process busy while another computes; idle after."""
    path = str(tmp_path / "board")
    script = textwrap.dedent(f"""
        import sys, torch
        from tinkerd import cores
        share = cores.CoreShare(board=cores.Board({path!r}, cores=2))
        seen = []
        with share.computing():
            seen.append(torch.get_num_threads())
            with share.computing():                                 # nested: the outer one stays busy
                pass
            assert share.board.count_busy() == 1
            print("ready", flush=True); sys.stdin.readline()       # the other process goes busy
            share.tick()
            seen.append(torch.get_num_threads())
        share.tick()                                                # outside: no effect
        import threading
        entered, leave = threading.Event(), threading.Event()
        def merger():
            with share.computing():
                entered.set(); leave.wait()
        t = threading.Thread(target=merger); t.start(); entered.wait()
        share.busy(); share.idle()            # another thread of the process stops: the merger still computes
        assert share.board.count_busy() == 2
        leave.set(); t.join()
        print(seen, share.board.count_busy(), flush=True)
    """)
    other = Other(path)
    try:
        proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
        assert proc.stdout.readline().strip() == "ready"
        other.say("busy")
        out, _ = proc.communicate("go\n", timeout=60)
    finally:
        other.kill()
    assert out.strip() == "[2, 1] 1", out                     # after: only the other one is busy


def test_the_trainer_engine_follows_the_board_in_every_layer_forward_and_backward(tmp_path, tiny_model_dir):
    """A TrainerEngine on the tiny model, its process on a 2-core board: every decoder layer
    sees 2 threads alone and 1 while another process computes, forward and backward; the
    process is idle on the board between calls."""
    path = str(tmp_path / "board")
    script = textwrap.dedent(f"""
        import sys, torch
        from tinkerd import cores
        from trainer_service.engine import TrainerEngine
        from trainer_service.lora import LoraSpec
        from trainer_service.training import DatumInput

        engine = TrainerEngine({tiny_model_dir!r}, zero_stage=0)
        engine.create_model("m", LoraSpec(rank=4, seed=0))
        cores._share = share = cores.CoreShare(board=cores.Board({path!r}, cores=2))
        ticks = []
        tick = share.tick
        share.tick = lambda: (tick(), ticks.append((torch.is_grad_enabled(), torch.get_num_threads())))
        data = [DatumInput([1, 2, 3, 4, 5], {{"target_tokens": torch.tensor([2, 3, 4, 5, 6]),
                                                "weights": torch.ones(5)}})]
        for _ in range(2):
            sys.stdin.readline()
            ticks.clear()
            engine.forward_backward("m", data, "cross_entropy", {{}}, forward_only=False)
            print("RESULT", ticks, share.board.count_busy(), flush=True)
    """)
    def result() -> tuple[str, str]:               # (DeepSpeed prints to stdout too)
        while not (line := proc.stdout.readline()).startswith("RESULT "):
            assert line, "the engine process ended"
        return line.removeprefix("RESULT ").rsplit(" ", 1)

    other = Other(path)
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    try:
        proc.stdin.write("alone\n")
        proc.stdin.flush()
        alone, busy_after = result()
        other.say("busy")
        proc.stdin.write("shared\n")
        proc.stdin.flush()
        shared, shared_after = result()
    finally:
        other.kill()
        proc.kill()
    alone, shared = eval(alone), eval(shared)
    layers = 2                                                # the tiny model's decoder layers
    forward = [t for grad, t in alone if grad]
    backward = [t for grad, t in alone if not grad]           # hooks in autograd's backward run without grad
    assert len(forward) == layers and len(backward) >= layers - 1, alone
    assert {t for _, t in alone} == {2}, alone
    assert {t for _, t in shared} == {1} and len(shared) == len(alone), shared
    assert int(busy_after) == 0 and int(shared_after) == 1    # idle between calls: only the other one


def test_a_trainer_started_with_omp_num_threads_set_keeps_its_workers_spinning(tmp_path, tiny_model_dir):
    """`tinkerd trainer` started with OMP_NUM_THREADS=2 in its environment, its engine built as
    serve() builds it (trainer_service/server.py build_engine: the threads are set before the model
    loads): the main thread loads with 1 thread, so the computing thread's pool is the process's
    only one, and its workers spin between back-to-back ops instead of sleeping. When the main
    thread loaded with 2 it kept a pool too, libgomp throttled every worker's spin (more pooled
    threads than cores), and each small op paid a futex sleep and wake: ~2 voluntary context
    switches an op (9,906 for 5,000 adds), SmolLM2 fp32 steps ~25% slower."""
    script = textwrap.dedent(f"""
        import resource, threading
        from tinkerd.process import cpu_defaults
        threads = cpu_defaults()                  # first, as serve() does
        import torch
        from tinkerd import cores
        from trainer_service.lora import LoraSpec
        from trainer_service.server import build_engine
        from trainer_service.settings import TrainerSettings
        from trainer_service.training import DatumInput

        engine = build_engine(TrainerSettings(base_model={tiny_model_dir!r}, state_dir={str(tmp_path)!r}), threads)
        data = [DatumInput(list(range(1, 65)), {{"target_tokens": torch.arange(2, 66), "weights": torch.ones(64)}})]
        def scheduler():                          # the servicer's computing thread
            engine.create_model("m", LoraSpec(rank=4, seed=0))
            engine.forward_backward("m", data, "cross_entropy", {{}}, forward_only=False)
            x = torch.randn(256, 576)
            with cores.share().computing():
                [x.add(x) for _ in range(200)]
                before = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
                [x.add(x) for _ in range(2000)]
                print("RESULT", torch.get_num_threads(), resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - before,
                      flush=True)
        computing = threading.Thread(target=scheduler); computing.start(); computing.join()
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "2", "TINKERD_CPU_THREADS": "2"})
    assert out.returncode == 0, out.stderr[-3000:]
    threads, sleeps = next(line for line in out.stdout.splitlines() if line.startswith("RESULT ")).split()[1:]
    assert int(threads) == 2
    # Measured: 232 (the process's other threads waking meanwhile), and 4,159 with the engine built first.
    assert int(sleeps) < 1000, f"{sleeps} voluntary context switches in 2,000 small ops on the computing thread"


def test_the_setting():
    assert cores.setting({}) == "auto"
    assert cores.setting({"OMP_NUM_THREADS": "3"}) == "3"     # the caller's fixed choice, as before
    assert cores.setting({"TINKERD_CPU_THREADS": "auto", "OMP_NUM_THREADS": "1"}) == "auto"
    with pytest.raises(UserError, match="TINKERD_CPU_THREADS must be `auto` or a positive number"):
        cores.setting({"TINKERD_CPU_THREADS": "0"})
    with pytest.raises(UserError, match="OMP_NUM_THREADS must be `auto` or a positive number"):
        cores.setting({"OMP_NUM_THREADS": "4,2"})             # the message names the variable read
    assert cores.quota_cores("max 100000") is None
    assert cores.quota_cores("150000 100000") == 2            # a 1.5-CPU container: 2 threads
    assert cores.quota_cores("50000 100000") == 1


def test_a_board_that_cannot_be_opened_leaves_one_fixed_thread(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(cores, "_share", cores.share())       # restored after
    share = cores.configure("auto", path=str(tmp_path / "missing" / "board"))
    assert share.mode == "fixed" and share.fixed == 1 and cores.share() is share
    assert "cannot be opened" in caplog.text
    share.busy(), share.tick(), share.idle()                  # no board: nothing to mark


@pytest.mark.parametrize("setting", ["auto", "2"])
def test_only_the_computing_thread_runs_an_openmp_pool(tmp_path, setting):
    """In a process of its own, configured as a service is (the board, or a fixed count): the
    computing thread runs 2 threads; any other thread, started before or after, runs 1, so a big
    op there (a weight receive's copy on a gRPC handler thread) starts no second pool of
    OpenMP workers (tinkerd/cores.py: with more pooled threads than cores every parallel op pays
    a futex wake-up). Pools are counted as the process's threads: a pool's workers live as long as
    the thread that started it. The last line checks that the count does see a second pool. (CI once
    counted 0 for the late side thread: `computing` had listed cores' just-joined reset thread.)"""
    script = textwrap.dedent(f"""
        import os, threading, time, torch
        from tinkerd import cores
        def tasks():   # settled: a thread just joined (cores' reset thread) can still be listed for a moment
            now, before = len(os.listdir("/proc/self/task")), -1
            while now != before:
                time.sleep(0.02)
                now, before = len(os.listdir("/proc/self/task")), now
            return now
        x = torch.randn(512, 1024)
        share = cores.configure({setting!r}, path={str(tmp_path / "board")!r})
        share.board and setattr(share.board, "cores", 2)
        def side(threads=None):
            ready, leave = threading.Event(), threading.Event()
            def run():
                threads and torch._C.set_num_threads(threads)
                seen.append(torch.get_num_threads()); x.add(x); ready.set(); leave.wait()
            t = threading.Thread(target=run); t.start(); ready.wait()
            return t, leave
        seen = []
        early, leave_early = side()
        with share.computing():
            seen.append(torch.get_num_threads()); x.add(x)
        computing = tasks()
        late, leave_late = side()
        after_side_ops = tasks()
        rogue, leave_rogue = side(threads=2)
        with_a_second_pool = tasks()
        for leave in (leave_early, leave_late, leave_rogue): leave.set()
        print(seen, with_a_second_pool - computing, after_side_ops - computing, flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    seen, second_pool, side_ops = out.stdout.strip().rsplit(" ", 2)
    assert seen == "[1, 2, 1, 2]", out.stdout                 # early side, computing, late side, rogue
    assert int(side_ops) == 1                                 # the late side thread itself, no worker
    assert int(second_pool) == 3                              # + the rogue thread and its pool's worker
