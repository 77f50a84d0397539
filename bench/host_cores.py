"""Where a CPU benchmark's processes run, and the CPU each one spends.

On a GPU host the device computes a step while the host's CPU cores serve: the SDK client, the
gateway, the trainer's gRPC handling. On a small CPU host all of them share the cores the step
computes on, so a step through the SDK pays for their CPU in compute time. Two instruments tell
the two apart:

- `CpuMeter`: the CPU time each named process spent in a row's steps, per step (user + system,
  every thread; OpenMP workers waiting at a barrier spin, and count). When the processes share
  the cores, their sum over the cores is a floor under the row's step.
- `Split`: the last `host` cores serve (the SDK's client process, the gateway) and the others
  compute (the trainer service and the in-process rows, with one thread per core), as on a GPU
  host. Then a step through the SDK costs what the serving side adds to the compute's critical
  path, the question a GPU run asks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import statistics
import time
from typing import Callable, Iterator


@dataclasses.dataclass(frozen=True)
class Split:
    compute: tuple[int, ...]        # the trainer and the in-process rows
    host: tuple[int, ...]           # the SDK client and the gateway

    @classmethod
    def of(cls, host_cores: int) -> "Split":
        """The last `host_cores` of the cores this process may use serve; the rest compute."""
        cores = tuple(sorted(os.sched_getaffinity(0)))
        if not 0 < host_cores < len(cores):
            raise ValueError(f"--host-cores {host_cores}: this process may use {len(cores)} cores; "
                             f"give the compute at least one and the host at least one")
        if shutil.which("taskset") is None:
            raise ValueError("--host-cores needs taskset (util-linux) to start the services on their cores")
        return cls(compute=cores[:-host_cores], host=cores[-host_cores:])

    def command(self, side: str, argv: list[str]) -> list[str]:
        """`argv` started on `side`'s cores ("compute" or "host"); its threads inherit them."""
        return ["taskset", "-c", ",".join(map(str, getattr(self, side))), *argv]

    @contextlib.contextmanager
    def computing_here(self) -> Iterator[None]:
        """This process on the compute cores, with a torch thread each; as it was after."""
        import torch

        cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
        torch.set_num_threads(len(self.compute))
        _move_threads(set(self.compute))
        try:
            yield
        finally:
            torch.set_num_threads(threads)
            _move_threads(cores)

    def describe(self) -> str:
        threads = f"{len(self.compute)} thread" + ("s" if len(self.compute) > 1 else "")
        return (f"compute on cores {','.join(map(str, self.compute))} ({threads}), "
                f"SDK client and gateway on {','.join(map(str, self.host))}")


def _move_threads(cores: set[int]) -> None:
    """Every thread of this process onto `cores`: a thread's affinity is its own, and OpenMP's
    workers would stay where they were."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:
            pass                # the thread ended meanwhile


def cpu_clock(pid: int) -> int:
    """The clock of process `pid`'s CPU time, all its threads (Linux's clock_getcpuclockid: a
    negative id, CPUCLOCK_SCHED). Nanosecond counts, where /proc's utime and stime are 10 ms ticks."""
    return ((~pid) << 3) | 2


class CpuMeter:
    """CPU time of named processes in the calls of the step it wraps: per step, the median over
    the calls (as the rows' times are medians)."""

    def __init__(self, pids: dict[str, int]):
        self.clocks = {name: cpu_clock(pid) for name, pid in pids.items()}
        self.calls: dict[str, list[float]] = {name: [] for name in pids}      # seconds a step, per call

    def _read(self) -> dict[str, float]:
        return {name: time.clock_gettime(clock) for name, clock in self.clocks.items()}

    def wrap(self, step: Callable[[], object], steps_per_call: int = 1) -> Callable[[], object]:
        def measured():
            before = self._read()
            out = step()
            after = self._read()
            for name, calls in self.calls.items():
                calls.append((after[name] - before[name]) / steps_per_call)
            return out
        return measured

    def ms_per_step(self) -> dict[str, float]:
        return {name: 1e3 * statistics.median(calls) for name, calls in self.calls.items() if calls}
