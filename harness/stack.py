"""Starting and stopping a whole `tinkerd up` from Python: used by the tests and the benchmarks."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from typing import NamedTuple

from tinkerd.process import stop_with_parent


class Stack(NamedTuple):
    url: str                 # TINKER_BASE_URL
    state_dir: str
    start_seconds: float     # `tinkerd up` to ready
    pid: int                 # of `tinkerd up`; its children are the services
    api_key: str             # an admin's key ("" with --no-auth)
    internal_url: str = ""   # the gateway's internal listener: /internal/ (the service token), /metrics



def _new_key(state, extra_args: tuple[str, ...], user: str = "admin") -> str:
    """Another key of the admin user (a restart on a database that has keys prints none)."""
    db_flags = [a for i, a in enumerate(extra_args) if a == "--db-url" or (i and extra_args[i - 1] == "--db-url")]
    out = subprocess.run([sys.executable, "-m", "launcher.cli", "keys", "create", "--user", user, "--admin",
                          "--state-dir", str(state), *db_flags], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


# A user's Ctrl-C: `tinkerd up` gives each service 15 s, and an idle stack stops in about 1 s.
STOP_WITHIN_S = 20.0


@contextlib.contextmanager
def running_stack(model_dir: str, state, *extra_args: str):
    """`tinkerd up` on `model_dir`; yields a Stack and stops it after. While it runs,
    TINKER_API_KEY in this process's environment is an admin key of this stack (the SDK reads it)."""
    t0 = time.monotonic()
    # The caller may have its own torch.distributed group (benchmarks run raw engines in-process).
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "launcher.cli", "up", "--base-model", model_dir, "--port", "0",
         "--state-dir", str(state), *extra_args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        preexec_fn=stop_with_parent())          # a killed test run leaves no stack serving
    url, api_key, internal_url = None, "", ""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        m = re.match(r"(?:export )?TINKER_(BASE_URL|API_KEY)=(\$\(cat .+\)|\S+)$", line.rstrip("\n"))
        if line.startswith("internal listener: "):
            internal_url = line.split()[2]
        if m and m.group(1) == "API_KEY":
            # `export TINKER_API_KEY=$(cat FILE)`: up writes the key to a file of mode 0600.
            with open(shlex.split(m.group(2).removeprefix("$(cat ").removesuffix(")"))[0]) as f:
                api_key = f.read().strip()
        elif m:
            url = m.group(2)
            break
    if url is None:
        proc.wait(timeout=30)
        logs = "".join(open(os.path.join(state, "logs", f)).read()[-3000:] for f in os.listdir(os.path.join(state, "logs")))
        raise RuntimeError("tinkerd up failed:\n" + "".join(lines) + logs)
    if not api_key and "--no-auth" not in extra_args:
        api_key = _new_key(state, extra_args)
    previous_key = os.environ.get("TINKER_API_KEY")
    os.environ["TINKER_API_KEY"] = api_key or "tml-no-auth"
    body_failed = True
    try:
        yield Stack(url, str(state), time.monotonic() - t0, proc.pid, api_key, internal_url)
        body_failed = False
    finally:
        if previous_key is None:
            os.environ.pop("TINKER_API_KEY", None)
        else:
            os.environ["TINKER_API_KEY"] = previous_key
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_WITHIN_S)
        except subprocess.TimeoutExpired:
            import psutil
            for child in psutil.Process(proc.pid).children(recursive=True):   # no orphans left serving
                child.kill()
            proc.kill()
            if not body_failed:         # else the body's own failure is the one to see
                raise AssertionError(f"`tinkerd up` did not stop within {STOP_WITHIN_S:.0f} s of SIGTERM") from None


def service_pids(root_pid: int) -> dict[str, int]:
    """{"trainer": pid, "sampler": pid, "gateway": pid} among the children of `tinkerd up`."""
    import psutil

    pids = {}
    for child in psutil.Process(root_pid).children(recursive=True):
        try:
            cmd = child.cmdline()
        except (psutil.ZombieProcess, psutil.NoSuchProcess):      # died, not reaped yet
            continue
        for name in ("trainer", "sampler", "gateway"):
            if len(cmd) > 3 and cmd[3] == name:
                pids[name] = child.pid
    return pids


def sampler_pool(stack, context=None) -> dict[str, dict]:
    """The gateway's sampler pool, {address: {"alive", "served", ...}} (GET
    /internal/v1/samplers/list on its internal listener, with the stack's service token; `context`:
    an ssl.SSLContext that trusts an https stack's certificate)."""
    with open(os.path.join(stack.state_dir, "service-token")) as f:
        token = f.read().strip()
    request = urllib.request.Request(f"{stack.internal_url}/internal/v1/samplers/list",
                                     headers={"authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10, context=context) as r:
        return {m["address"]: m for m in json.load(r)["samplers"]}
