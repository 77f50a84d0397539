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
import time

import pytest

from launcher import up


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
