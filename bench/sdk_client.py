"""The SDK's training steps (bench/trainer_only.sdk_steps) in a process of their own, as a user's
client runs them.

Why not in the bench's process: it has just run torch steps of its own (the plain and engine
rows, taken in turn with the SDK's), and torch's OpenMP workers spin for a while after each
parallel op before they sleep. Those spins were charged to the SDK rows: on 2 shared cores the
client spent 14.6 ms of CPU a tiny 4x64 step in the bench's process, 7.6 ms in a process of its
own (2026-12-04), and on 2 cores the spinning competed with the trainer. A user's client has no
such workers.

One call and its answer cross a pipe (tens of microseconds) on top of the SDK's own work.
"""

from __future__ import annotations

import multiprocessing
import os
import traceback


class SdkClient:
    """A spawned process holding a tinker.ServiceClient of `url` and the training client of
    sdk_steps; `steps(n)` runs n steps there (1 or PIPELINED) and returns their summed loss."""

    def __init__(self, url: str, model_dir: str, sequences: list[list[int]], setup, cores: tuple[int, ...] = ()):
        context = multiprocessing.get_context("spawn")      # no copy of this process's torch state
        self._conn, theirs = context.Pipe()
        self.process = context.Process(target=_serve, args=(theirs, url, model_dir, sequences, setup, cores),
                                       name="sdk-client", daemon=True)
        self.process.start()
        theirs.close()
        self._answer()          # its training client exists

    @property
    def pid(self) -> int:
        return self.process.pid

    def steps(self, n: int) -> float:
        self._conn.send(n)
        return self._answer()

    def _answer(self):
        if not self._conn.poll(600):
            raise RuntimeError("the SDK client process did not answer within 600 s")
        kind, value = self._conn.recv()
        if kind == "error":
            raise RuntimeError(f"the SDK client process failed:\n{value}")
        return value

    def close(self) -> None:
        """Closes its ServiceClient (as a finished run does), then it exits."""
        try:
            self._conn.send(None)
            self._answer()
        finally:
            self.process.join(60)
            if self.process.is_alive():
                self.process.kill()


def _serve(conn, url: str, model_dir: str, sequences: list[list[int]], setup, cores: tuple[int, ...]) -> None:
    try:
        if cores:
            os.sched_setaffinity(0, cores)      # before the SDK starts its threads: they inherit it
        import tinker

        from bench.trainer_only import PIPELINED, sdk_steps

        service = tinker.ServiceClient(base_url=url)
        one, pipelined = sdk_steps(service, model_dir, sequences, setup)
        run = {1: one, PIPELINED: pipelined}
        conn.send(("ready", None))
        while (n := conn.recv()) is not None:
            conn.send(("loss", run[n]()))
        service.close("success").result()
        conn.send(("closed", None))
    except Exception:  # noqa: BLE001 - the parent raises it with this traceback
        conn.send(("error", traceback.format_exc()))
