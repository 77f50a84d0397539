"""One `tinkerd` service started by hand, without `tinkerd up`: its own process session, its
output in a log file, ready once it prints `READY <service> <port>`. For the tests that wire
services themselves (tests/e2e/test_scale_out.py) and the benchmarks that start only some of
them (bench/trainer_services.py)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from typing import Callable

from tinkerd.process import stop_with_parent

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Service:
    """A `tinkerd` service in its own process group; stdout and stderr go to its log file."""

    def __init__(self, name: str, command: list[str], log_dir, env: dict, enter: Callable[[], None] | None = None):
        """`enter`: run in the child before the command (harness/hosts.py: onto another host)."""
        self.name, self.command, self.env, self.enter = name, command, env, enter
        self.log = os.path.join(log_dir, f"{name}.log")
        self.start()

    def start(self) -> None:
        self.offset = os.path.getsize(self.log) if os.path.exists(self.log) else 0
        stop, enter = stop_with_parent(), self.enter           # none left serving if we are killed
        self.proc = subprocess.Popen(self.command, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT,
                                     env=self.env, cwd=ROOT, start_new_session=True,
                                     preexec_fn=(lambda: (stop(), enter())) if enter else stop)

    def text(self) -> str:
        """This start's log."""
        with open(self.log, errors="replace") as f:
            f.seek(self.offset)
            return f.read()

    def ready(self, timeout_s: float = 300) -> int:
        """Waits for `READY <service> <port>`; returns the port."""
        deadline = time.monotonic() + timeout_s
        while not (m := re.search(r"^READY \w+ (\d+)$", self.text(), re.M)):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n{self.text()[-4000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not ready:\n{self.text()[-4000:]}")
            time.sleep(0.1)
        return int(m.group(1))

    def stop(self, timeout_s: float = 30) -> None:
        """SIGTERM (a clean stop), then SIGKILL if it has not exited within `timeout_s`."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self, sig=signal.SIGKILL) -> None:
        """Signals the service and everything it started: torchrun starts each rank in a session
        of its own, so the process group alone would leave the ranks running."""
        import psutil

        if self.proc.poll() is None:
            children = psutil.Process(self.proc.pid).children(recursive=True)
            os.killpg(self.proc.pid, sig)
            for child in children:
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.send_signal(sig)
        self.proc.wait(timeout=60)
