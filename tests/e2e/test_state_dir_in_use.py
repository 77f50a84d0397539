"""A second stack on a state dir in use is refused before it starts anything (tinkerd/state_lock.py):
it would share the first's checkpoints and models' durable state, and its trainer would overwrite
the first's. The user's three ways there: `tinkerd up` again while one runs, `tinkerd up` while the
trainer of an earlier, killed one still runs, and a `tinkerd trainer` started by hand."""

from __future__ import annotations

import os
import urllib.request

import pytest
from conftest import held_elsewhere, run_tinkerd

pytestmark = pytest.mark.e2e


def test_tinkerd_up_on_a_running_stacks_state_dir_is_refused_and_the_stack_serves_on(stack, tiny_model_dir):
    logs_before = {f: os.path.getsize(os.path.join(stack.state_dir, "logs", f))
                   for f in os.listdir(os.path.join(stack.state_dir, "logs"))}
    second = run_tinkerd("up", "--base-model", tiny_model_dir, "--state-dir", stack.state_dir, "--port", "0")
    assert second.returncode == 1, (second.stdout, second.stderr)
    assert f"is in use by `tinkerd up` serving {stack.url}" in second.stderr, second.stderr
    assert "two stacks" in second.stderr and "Traceback" not in second.stderr, second.stderr
    assert "ready" not in second.stdout
    logs_after = {f: os.path.getsize(os.path.join(stack.state_dir, "logs", f))
                  for f in os.listdir(os.path.join(stack.state_dir, "logs"))}
    assert logs_after.keys() == logs_before.keys()           # no service of its own started
    with urllib.request.urlopen(f"{stack.url}/api/v1/healthz", timeout=10) as r:
        assert r.status == 200


def test_tinkerd_up_beside_a_trainer_left_running_is_refused_naming_it(tmp_path, tiny_model_dir):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    with held_elsewhere(state, "trainer", "`tinkerd trainer` (--listen 127.0.0.1:0)") as trainer:
        up = run_tinkerd("up", "--base-model", tiny_model_dir, "--state-dir", str(state), "--port", "0")
        assert up.returncode == 1, (up.stdout, up.stderr)
        assert f"in use by `tinkerd trainer` (--listen 127.0.0.1:0) (pid {trainer.pid})" in up.stderr, up.stderr
        assert sorted(os.listdir(state)) == ["trainer.lock", "up.lock"]     # nothing started, nothing written


def test_a_trainer_on_a_state_dir_in_use_exits_before_loading_the_model(tmp_path, tiny_model_dir):
    with held_elsewhere(tmp_path, "trainer", "`tinkerd trainer` (--listen 127.0.0.1:7001)") as first:
        second = run_tinkerd("trainer", "--base-model", tiny_model_dir, "--state-dir", str(tmp_path),
                          "--listen", "127.0.0.1:0")
    assert second.returncode == 1, (second.stdout, second.stderr)
    assert (f"tinkerd trainer: the state dir {tmp_path} is in use by `tinkerd trainer` (--listen 127.0.0.1:7001) "
            f"(pid {first.pid}): two trainers") in second.stderr, second.stderr
    assert "Traceback" not in second.stderr and "READY" not in second.stdout


def test_the_services_of_a_killed_up_stop_and_free_the_state_dir(start_stack, tiny_model_dir, tmp_path):
    """`tinkerd up` killed outright (SIGKILL, the OOM killer, its terminal closed) used to leave its
    trainer, sampler and gateway serving on their own, holding the ports and the state dir: each now
    gets SIGTERM, its clean stop, and the next `up` finds the state dir free."""
    import signal

    import psutil

    from harness.stack import service_pids
    from tinkerd import state_lock

    state = tmp_path / "a state dir"          # (a space: `up` prints its key file's path quoted for the shell)
    with start_stack(tiny_model_dir, state) as stack:
        services = [psutil.Process(pid) for pid in service_pids(stack.pid).values()]
        assert len(services) == 3
        os.kill(stack.pid, signal.SIGKILL)
        _, alive = psutil.wait_procs(services, timeout=60)
        assert not alive, [p.cmdline()[:4] for p in alive]
    for name in ("up", "trainer"):
        state_lock.check_free(str(state), name)
