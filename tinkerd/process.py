"""Process-level helpers every service entry point shares: logging, env defaults, and running a
gRPC server until SIGTERM/SIGINT."""

from __future__ import annotations

import ctypes.util
import gc
import logging
import os
import signal
import sys
import threading


def init_logging(name: str) -> None:
    level = os.environ.get("TINKERD_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level, format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s")


def freeze_heap(collect: bool = True) -> None:
    """Moves every object alive now out of the cyclic collector's reach (gc.freeze), as vLLM's
    engine does after start-up: modules, the app, a tokenizer's tables live as long as the
    process, and each full collection walked them all. In the gateway, with transformers loaded,
    one held the GIL long enough for every request to wait
    (docs/benchmarks.md#in-the-gateway-and-every-process). Frozen objects are still freed when
    their last reference goes; only cycles among them stay. `collect` first (a pause of its own)
    so the garbage of start-up is not frozen with them; skip it where the caller must not pause
    the process."""
    if collect:
        gc.collect()
    gc.freeze()


def cpu_defaults() -> str:
    """More than one OpenMP thread per process oversubscribes the cores once trainer and
    sampler run side by side (docs/benchmarks.md#in-the-gateway-and-every-process); so a service
    starts with one, and takes more from the host's core board (tinkerd/cores.py). Returns the
    CPU threads setting for cores.configure, read before OMP_NUM_THREADS gets its default."""
    from tinkerd import cores

    threads = cores.setting(os.environ)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return threads


TCMALLOC = "tcmalloc_minimal"     # Debian/Ubuntu: libtcmalloc-minimal4


def tcmalloc_preload(environ: dict) -> str | None:
    """The LD_PRELOAD value that adds tcmalloc, or None when it is there already, switched off
    (TINKERD_TCMALLOC=0) or not installed."""
    preload = environ.get("LD_PRELOAD", "")
    if environ.get("TINKERD_TCMALLOC", "1") == "0" or "tcmalloc" in preload:
        return None
    lib = tcmalloc_library()
    if lib is None:
        return None
    return f"{lib}:{preload}" if preload else lib


def tcmalloc_library() -> str | None:
    """The installed tcmalloc's library name (scripts/setup.sh installs it), or None."""
    return ctypes.util.find_library(TCMALLOC)


def reexec_with_tcmalloc() -> None:
    """Runs this process again (same pid, same command line) with tcmalloc preloaded. The sampler:
    vLLM's CPU backend asks for it, and samples faster under it
    (docs/benchmarks.md#in-the-gateway-and-every-process). The trainer: glibc returns its large
    blocks (a step's logits and their gradients, ~80 MB each) to the kernel at every free, so
    each step faults them in again, zeroed; tcmalloc keeps them for the next step
    (bench/allocator.py). A preload must be in place when the process starts, hence the exec;
    call it before anything heavy is imported."""
    preload = tcmalloc_preload(os.environ)
    if preload is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, {**os.environ, "LD_PRELOAD": preload})


def allocator(pid: int | str = "self") -> str:
    """"tcmalloc" if process `pid` (this one by default) runs with it, else "glibc malloc"."""
    with open(f"/proc/{pid}/maps") as f:
        return "tcmalloc" if "libtcmalloc" in f.read() else "glibc malloc"


def serve_until_signal(server, port: int, name: str, on_start=None, on_stop=None, health=None) -> None:
    """`health` (tinkerd/health.py): SERVING once started, NOT_SERVING from the signal on."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    if health:
        health.serving()
    logging.getLogger(name).info("%s serving gRPC on port %d", name, port)
    if on_start:
        on_start()
    print(f"READY {name} {port}", flush=True)
    # Polled, not one long wait: Python runs signal handlers on the main thread only, and a main
    # thread parked in a lock wakes for a signal only if the kernel delivered it to that thread.
    while not stop.wait(timeout=0.5):
        pass
    if health:
        health.stopping()
    server.stop(grace=2).wait()
    if on_stop:
        on_stop()


def stop_with_parent():
    """For Popen's preexec_fn (Linux; None elsewhere): the child is sent SIGTERM, a service's clean
    stop, when the process that started it dies, however it dies (SIGKILL, the OOM killer, its
    terminal closed). A service started in a session of its own (so that a Ctrl-C reaches only
    `tinkerd up`, which stops them in order) is otherwise left serving, holding its ports, its GPU
    memory and the state dir (tinkerd/state_lock.py). Start children from a thread that lives as
    long as the process: the kernel ties this to the thread that forked."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl     # looked up here: the child only calls it
    parent = os.getpid()

    def in_child() -> None:
        prctl(1, signal.SIGTERM)        # PR_SET_PDEATHSIG, kept across exec
        if os.getppid() != parent:      # the parent died before that
            os._exit(1)
    return in_child


def exit_now(code: int = 0) -> None:
    """Ends the process at once, logs and output flushed, without the interpreter's teardown: for
    a service whose shutdown is done (on a sampler the teardown spent ~2 s garbage-collecting
    vLLM's and torch's heap, for every stop and restart of a replica; on a trainer rank it could
    abort in gloo's leftovers), and for a broken trainer rank (code 1)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def service_dtype(requested: str, allow_slow: bool) -> str:
    """The dtype a service runs (tinkerd/hardware.py decides `auto`), logged with why; a refused
    one ends the process at start-up with the reason, not minutes into a run."""
    from tinkerd.hardware import DtypeRefused, resolve_dtype

    try:
        dtype = resolve_dtype(requested, allow_slow=allow_slow)
    except DtypeRefused as e:
        raise SystemExit(f"tinkerd: {e}") from None
    logging.getLogger("tinkerd").info("weights dtype %s (requested %s)", dtype, requested)
    return dtype
