"""`tinkerd up` stops promptly on Ctrl-C or SIGTERM wherever the signal lands (launcher/up.py).

The supervisor polls its children every half second. A signal that lands inside `Popen.poll()`,
while that frame holds the child's wait lock, used to stop the children from inside the handler:
`wait(timeout=15)` then spun on the held lock for the whole timeout, child after child (found with
py-spy on a stack that took 45 s to stop). Here the signal is sent while the lock is held, as
poll() holds it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from launcher import up

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def restored_signals():
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_a_signal_inside_a_childs_poll_unwinds_and_the_stop_is_prompt(restored_signals):
    child = subprocess.Popen(["sleep", "60"])
    try:
        up.unwind_on_stop_signals()
        t0 = time.monotonic()
        with pytest.raises(SystemExit) as stopped:
            with child._waitpid_lock:             # what Popen.poll() holds (CPython's subprocess)
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)                     # the handler runs here, on this thread
        assert stopped.value.code == 0 and time.monotonic() - t0 < 2     # unwound at once, nothing waited for
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN    # a second signal cannot cut the stop short
        t0 = time.monotonic()
        up._stop_all({"sleeper": child})
        assert time.monotonic() - t0 < 5 and child.returncode is not None
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


_SERVICE = """
import signal, sys, time
def stop(*_):
    open(sys.argv[1], "w").write("stopped cleanly")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("READY service 1", flush=True)
time.sleep(120)
"""

_UP = """
import sys, time
from launcher import up
ready = {}
child = up._start("service", [sys.executable, "-c", sys.argv[1], sys.argv[2]], ready, sys.argv[3], {})
while "service" not in ready:        # its SIGTERM handler is in place
    time.sleep(0.01)
print(child.pid, flush=True)
time.sleep(120)
"""


def test_the_services_of_a_killed_up_get_their_clean_stop(tmp_path):
    """`tinkerd up` killed outright (SIGKILL, the OOM killer, its terminal closed) runs no clean-up
    of its own; each service it started, in a session of its own, still gets SIGTERM, its clean
    stop, instead of serving on with the ports, the GPU and the state dir."""
    import psutil

    stopped = tmp_path / "stopped"
    stand_in = subprocess.Popen([sys.executable, "-c", _UP, _SERVICE, str(stopped), str(tmp_path)],
                                cwd=ROOT, stdout=subprocess.PIPE, text=True)
    service = psutil.Process(int(stand_in.stdout.readline()))
    try:
        assert service.is_running() and os.getsid(service.pid) != os.getsid(stand_in.pid)
        stand_in.kill()
        stand_in.wait(timeout=30)
        service.wait(timeout=10)            # (not our child: its exit code is not ours to read)
        assert stopped.read_text() == "stopped cleanly"
    finally:
        if service.is_running():
            service.kill()
