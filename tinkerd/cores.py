"""The host's CPU cores shared between the compute services on it, by who is busy right now.

A trainer and a sampler on one CPU host take turns more often than they overlap (an RL loop
samples, then trains, then samples), and one OpenMP thread each (the old fixed default) left
most of the host's cores idle in each phase; more threads each oversubscribe the cores whenever
both compute at once (docs/benchmarks.md#in-the-gateway-and-every-process). So each compute
process takes `cores // busy` threads, where `busy` counts the compute processes of this host
computing now, itself included: alone, every core; side by side, a share.

The board: one small shared-memory file per user (/dev/shm/tinkerd-cores-<uid>), a slot of 8
bytes per process, claimed with a POSIX record lock on its byte (freed by the kernel when the
process dies, so a new process takes the slot over). A busy process writes "busy until now +
LEASE_S" (CLOCK_MONOTONIC: one clock per host) and renews it while it computes; idle, 0. A
process that dies while busy stops counting when its lease runs out. Reading the board is one
pass over a few hundred doubles (microseconds), done before each sampler engine step and each
trainer decoder layer, forward and backward, so a share follows the other side within one layer.

OpenMP's thread count is per calling thread: `busy()` sets it on the thread that computes.
Processes outside the board (the gateway, clients, another program) are not counted.
TINKERD_CPU_THREADS=N (or an OMP_NUM_THREADS given to the service) fixes N threads instead;
library use (an engine built in a script or a test) leaves torch's threads alone.

One OpenMP pool per process: in a service only the computing threads (those inside `busy()`)
run parallel ops; every other thread runs torch with 1 thread. libgomp keeps a pool of worker
threads for each thread that ran a parallel op, for as long as that thread lives, and once a
process's pooled threads outnumber its cores, every worker sleeps after ~100 spins instead of
~300,000, so each parallel op then pays a futex wake-up: beside one idle pool (a gRPC handler
thread's, after a weight receive's copy) a small op runs several times slower and a training step
markedly slower (docs/benchmarks.md#in-the-gateway-and-every-process). A computing thread that
does not live on (the sampler's merger) ends when its work is done, and its pool with it.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import mmap
import os
import struct
import tempfile
import threading
import time

log = logging.getLogger(__name__)

SLOTS = 256
LEASE_S = 2.0
_SLOT = struct.Struct("d")
_ALL = struct.Struct(f"{SLOTS}d")


def _set_num_threads(n: int) -> None:
    """This thread's OpenMP (and MKL) threads. torch's setter also makes `n` the count of every
    thread that has not run a parallel op yet, so a short-lived thread sets that back to 1: a
    gRPC handler or other side thread must not start a pool of its own (module docstring)."""
    # torch's builtin: vLLM's CPU worker replaces torch.set_num_threads with a no-op once it is up.
    # (torch is imported here, not above: a service reads its setting before OMP_NUM_THREADS is set.)
    import torch
    torch.get_num_threads()      # torch's first-use set-up of this thread, which would reset it to the default
    torch._C.set_num_threads(n)
    if n != 1:
        reset = threading.Thread(target=torch._C.set_num_threads, args=(1,), name="cores-default-threads")
        reset.start()
        reset.join()


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity, bounded by a cgroup v2 CPU quota
    (a container's --cpus or a pod's CPU limit, which affinity does not show)."""
    cores = len(os.sched_getaffinity(0))
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            return min(cores, quota_cores(f.read()) or cores)
    except OSError:
        return cores


def quota_cores(cpu_max: str) -> int | None:
    """Whole cores of a cgroup v2 `cpu.max` ("<quota> <period>", or "max <period>": none)."""
    quota, _, period = cpu_max.strip().partition(" ")
    if quota == "max" or not period:
        return None
    return max(1, math.ceil(int(quota) / int(period)))


def board_path() -> str:
    shm = "/dev/shm"
    return os.path.join(shm if os.path.isdir(shm) else tempfile.gettempdir(), f"tinkerd-cores-{os.getuid()}")


class Board:
    """This process's slot on the host's board (one per process: closing any descriptor of the
    file would drop every lock the process holds on it)."""

    def __init__(self, path: str, cores: int, lease_s: float = LEASE_S):
        self.path, self.cores, self.lease_s = path, cores, lease_s
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        if os.fstat(self._fd).st_size < _ALL.size:
            os.ftruncate(self._fd, _ALL.size)
        self._map = mmap.mmap(self._fd, _ALL.size)
        self.slot = self._claim()
        if self.slot is None:
            log.warning("all %d slots of %s are taken: this process keeps 1 thread", SLOTS, path)
        else:
            self._write(0.0)          # a dead owner's lease is not ours

    def _claim(self) -> int | None:
        for slot in range(SLOTS):
            try:
                fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, slot * _SLOT.size)
                return slot
            except OSError:
                continue
        return None

    def _write(self, value: float) -> None:
        _SLOT.pack_into(self._map, self.slot * _SLOT.size, value)

    def busy(self) -> int:
        """Marks this process busy for the next lease; the threads it may use now."""
        if self.slot is None:
            return 1
        now = time.monotonic()
        self._write(now + self.lease_s)
        return max(1, self.cores // self.count_busy(now))

    def idle(self) -> None:
        if self.slot is not None:
            self._write(0.0)

    def count_busy(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        return sum(until > now for until in _ALL.unpack_from(self._map))


class CoreShare:
    """The threads of this process's computing thread(s): fixed, or from the board."""

    def __init__(self, board: Board | None = None, fixed: int | None = None):
        self.board, self.fixed = board, fixed
        self._local = threading.local()          # the count set on each thread (OpenMP's is per thread)
        self._busy: set[int] = set()             # threads computing now: the process's one slot is
        self._guard = threading.Lock()           # idle only once none is (a sampler's merger, its engine)

    @property
    def mode(self) -> str:
        if self.board is not None:
            return "shared"
        return "library" if self.fixed is None else "fixed"

    def busy(self) -> None:
        """This thread computes now (call again to renew while it does): its thread count follows
        the board, or is the fixed one."""
        if self.board is not None:
            with self._guard:
                self._busy.add(threading.get_ident())
            self._apply(self.board.busy())
        elif self.fixed is not None:
            self._apply(self.fixed)

    def idle(self) -> None:
        """This thread stops computing; the process is idle on the board once no thread computes."""
        if self.board is not None:
            with self._guard:
                self._busy.discard(threading.get_ident())
                if not self._busy:
                    self.board.idle()

    @contextlib.contextmanager
    def computing(self):
        """Busy for the block, idle after (so the other side gets the cores at once, not after the
        lease); a block inside another one leaves the outer one busy."""
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        self.busy()
        try:
            yield
        finally:
            self._local.depth = depth
            if depth == 0:
                self.idle()

    def tick(self) -> None:
        """Inside `computing`: renew the lease and follow the board (a layer's hook calls it)."""
        if self.board is not None and getattr(self._local, "depth", 0):
            self._apply(self.board.busy())

    def _apply(self, n: int) -> None:
        if getattr(self._local, "threads", None) != n:
            _set_num_threads(n)
            self._local.threads = n
            THREADS.set(n)


def _gauge():
    from prometheus_client import Gauge
    return Gauge("tinkerd_cpu_threads", "OpenMP threads this service's computing thread uses now (tinkerd/cores.py: "
                 "the host's cores divided among the busy trainer and sampler processes, or a fixed number)")


THREADS = _gauge()
_share = CoreShare()


def share() -> CoreShare:
    """This process's share (a no-op one until a service calls `configure`)."""
    return _share


def setting(environ: dict) -> str:
    """"auto" or a thread count: TINKERD_CPU_THREADS, else an OMP_NUM_THREADS the caller set (a
    fixed choice, as before the board), else auto. tinkerd.process.cpu_defaults() reads it
    before it sets OMP_NUM_THREADS itself."""
    name = next((n for n in ("TINKERD_CPU_THREADS", "OMP_NUM_THREADS") if environ.get(n)), "")
    value = environ[name] if name else "auto"
    if value != "auto" and not (value.isdigit() and int(value) > 0):
        from tinkerd.errors import UserError
        raise UserError(f"{name} must be `auto` or a positive number of threads, got {value!r}")
    return value


def configure(value: str, *, cpu: bool = True, path: str | None = None) -> CoreShare:
    """A service's share, from `setting()`: the board when "auto" on a CPU host; a GPU host
    computes on the GPU and keeps OpenMP's fixed count (1 unless set). Either way a computing
    thread takes its count in `busy()`, and every other thread runs 1. A board that cannot be opened (no
    writable /dev/shm or temporary directory) leaves one fixed thread, said in the log."""
    global _share
    path = path or board_path()
    _set_num_threads(1)         # every thread but the computing ones (busy() sets theirs)
    board = None
    if value == "auto" and cpu:
        try:
            board = Board(path, usable_cores())
        except OSError as e:
            log.warning("CPU threads: the core board %s cannot be opened (%s): 1 thread; TINKERD_CPU_THREADS=N "
                        "fixes another number", path, e)
    if board is not None:
        _share = CoreShare(board=board)
        log.info("CPU threads: the host's %d cores shared by the busy trainer and sampler processes (board %s, "
                 "slot %s; TINKERD_CPU_THREADS=N fixes N)", board.cores, board.path, board.slot)
    else:
        fixed = 1 if value == "auto" else int(value)
        THREADS.set(fixed)
        _share = CoreShare(fixed=fixed)
        log.info("CPU threads: %d (fixed)", fixed)
    return _share


def tick_in_layers(model) -> int:
    """Makes each decoder layer of `model` (the longest ModuleList: a transformer's blocks) call
    `share().tick()` as its forward starts and as its backward reaches it (a hook on its input's
    gradient), so a long step follows the board layer by layer. Returns the layers hooked."""
    import torch
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        return 0
    layers = max(lists, key=len)

    def on_grad(grad):
        _share.tick()

    def before(module, args, kwargs):
        _share.tick()
        hidden = args[0] if args else kwargs.get("hidden_states")
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(on_grad)

    for layer in layers:
        layer.register_forward_pre_hook(before, with_kwargs=True)
    return len(layers)
