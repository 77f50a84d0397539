"""Starting and stopping a whole `tinkerd up` from Python: used by the tests and the benchmarks."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from typing import NamedTuple


class Stack(NamedTuple):
    url: str                 # TINKER_BASE_URL
    state_dir: str
    start_seconds: float     # `tinkerd up` to ready
    pid: int                 # of `tinkerd up`; its children are the services



@contextlib.contextmanager
def running_stack(model_dir: str, state, *extra_args: str):
    """`tinkerd up` on `model_dir`; yields a Stack and stops it after."""
    t0 = time.monotonic()
    # The caller may have its own torch.distributed group (benchmarks run raw engines in-process).
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "launcher.cli", "up", "--base-model", model_dir, "--port", "0",
         "--state-dir", str(state), *extra_args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url = None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        m = re.match(r"TINKER_BASE_URL=(\S+)", line)
        if m:
            url = m.group(1)
            break
    if url is None:
        proc.wait(timeout=30)
        logs = "".join(open(os.path.join(state, "logs", f)).read()[-3000:] for f in os.listdir(os.path.join(state, "logs")))
        raise RuntimeError("tinkerd up failed:\n" + "".join(lines) + logs)
    try:
        yield Stack(url, str(state), time.monotonic() - t0, proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def service_pids(root_pid: int) -> dict[str, int]:
    """{"trainer": pid, "sampler": pid, "gateway": pid} among the children of `tinkerd up`."""
    import psutil

    pids = {}
    for child in psutil.Process(root_pid).children(recursive=True):
        cmd = child.cmdline()
        for name in ("trainer", "sampler", "gateway"):
            if len(cmd) > 3 and cmd[3] == name:
                pids[name] = child.pid
    return pids
