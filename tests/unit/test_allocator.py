"""The sampler runs with tcmalloc preloaded, as vLLM's CPU backend asks (tinkerd/process.py):
measured on SmolLM2 through a rank-8 adapter, 26.9 against 23.3 tokens/s."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tinkerd.process import tcmalloc_preload


@pytest.mark.tcmalloc
def test_preload_adds_tcmalloc_before_what_is_there():
    assert "tcmalloc" in tcmalloc_preload({})
    both = tcmalloc_preload({"LD_PRELOAD": "/x/libgomp.so.1"})
    assert both.endswith(":/x/libgomp.so.1") and "tcmalloc" in both.split(":")[0]


def test_no_preload_when_switched_off_or_already_there():
    assert tcmalloc_preload({"TINKERD_TCMALLOC": "0"}) is None
    assert tcmalloc_preload({"LD_PRELOAD": "/usr/lib/libtcmalloc.so.4"}) is None


@pytest.mark.tcmalloc
def test_a_process_reexecs_itself_with_tcmalloc_keeping_its_pid_and_arguments():
    script = ("import os, sys\n"
              "print('start', os.getpid(), sys.argv[1:], flush=True)\n"
              "from tinkerd.process import allocator, reexec_with_tcmalloc\n"
              "reexec_with_tcmalloc()\n"
              "print('after', os.getpid(), allocator(), sys.argv[1:])\n")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "TINKERD_TCMALLOC")}
    out = subprocess.run([sys.executable, "-c", script, "a", "b"], capture_output=True, text=True, env=env,
                         timeout=60, check=True).stdout.split("\n")
    starts = [line for line in out if line.startswith("start")]
    assert len(starts) == 2 and starts[0] == starts[1], out        # ran twice: before and after the exec
    pid = starts[0].split()[1]
    assert f"after {pid} tcmalloc ['a', 'b']" in out, out
    off = subprocess.run([sys.executable, "-c", script, "a"], capture_output=True, text=True, timeout=60, check=True,
                         env={**env, "TINKERD_TCMALLOC": "0"}).stdout
    assert off.count("start") == 1 and "glibc malloc" in off
