"""What every benchmark shares: result rows, timing, the models, and a running stack."""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import os
import statistics
import tempfile
import time
from typing import Callable, Iterator

from harness.stack import Stack, running_stack

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass
class Row:
    benchmark: str
    case: str                       # what was measured (model, size, ...)
    ours: float                     # through tinkerd
    raw: float | None               # the raw engine, same work, same run
    unit: str
    ratio: float | None = None      # the figure of merit, oriented so that higher is better
    target: str = ""                # e.g. ">= 0.9"
    met: bool | None = None
    note: str = ""


def options(flags: tuple[str, ...]) -> set[tuple[str, str]]:
    """`tinkerd up` flags as (option, value) pairs: ("--a", "1", "--b") -> {("--a", "1"), ("--b", "")}."""
    pairs, i = set(), 0
    while i < len(flags):
        has_value = i + 1 < len(flags) and not flags[i + 1].startswith("--")
        pairs.add((flags[i], flags[i + 1] if has_value else ""))
        i += 2 if has_value else 1
    return pairs


class SharedStack:
    """The quick run's one `tinkerd up` on the tiny model, fp32, with the flags its benchmarks ask
    for in that run (their QUICK_STACK_FLAGS: tenants' limits, soak's retentions), started on first
    use and stopped by close(): a stack start is ~30 s on 2 cores, most of the smoke run's time when
    every benchmark started its own."""
    DTYPE = ("--dtype", "float32")

    def __init__(self, model_dir: str, state_dir: str, flags: tuple[str, ...] = ()):
        self.model_dir, self.state_dir, self.flags = model_dir, state_dir, self.DTYPE + flags
        self._exit = contextlib.ExitStack()
        self._stack: Stack | None = None

    def serves(self, model_dir: str, flags: tuple[str, ...]) -> bool:
        """Whether a stack of `flags` on `model_dir` may be this one: each option asked for set as asked."""
        return model_dir == self.model_dir and options(flags) <= options(self.flags)

    def get(self) -> Stack:
        if self._stack is None:
            self._stack = self._exit.enter_context(running_stack(self.model_dir, self.state_dir, *self.flags))
        # A benchmark's own stack, stopped, put back the key from before it: this stack's is needed.
        os.environ["TINKER_API_KEY"] = self._stack.api_key
        return self._stack

    def close(self) -> None:
        self._exit.close()


# The quick run's engines on the tiny model, ours and raw vLLM alike, size their KV cache for it
# (its longest batch, 64 x 1,024 tokens, needs 32 MiB): a CPU engine zeroes the whole cache at
# start, and the default 1 GiB costs 4-6 s of CPU per engine on 2 cores.
QUICK_TINY_KV_CACHE_MIB = 64


@dataclasses.dataclass
class Context:
    quick: bool                     # a few iterations, for the smoke test
    work_dir: str
    models: dict[str, str]          # "tiny" / "smollm2" -> local directory
    shared: SharedStack | None = None   # the quick run's stack

    def iters(self, full: int, quick: int = 2) -> int:
        return quick if self.quick else full

    def kv_cache_mib(self, model_dir: str) -> int:
        """The KV cache of every engine on `model_dir` in this run, in MiB (0: the default, 1 GiB on CPU)."""
        return QUICK_TINY_KV_CACHE_MIB if self.quick and model_dir == self.models.get("tiny") else 0

    def stack_flags(self, model_dir: str, flags: tuple[str, ...]) -> tuple[str, ...]:
        """`flags` of a `tinkerd up` on `model_dir`, with this run's KV cache unless they size one."""
        mib = self.kv_cache_mib(model_dir)
        return flags if not mib or "--kv-cache-mib" in flags else (*flags, "--kv-cache-mib", str(mib))


def raw_kv_cache(kv_cache_mib: int) -> dict:
    """vllm.LLM's arguments for a KV cache of `kv_cache_mib` (0: the default), sized as our sampler sizes it."""
    from sampler_service.engine import size_cpu_kv_cache

    size_cpu_kv_cache(kv_cache_mib)
    return {"kv_cache_memory_bytes": kv_cache_mib << 20} if kv_cache_mib else {}


@contextlib.contextmanager
def tinkerd_up(ctx: Context, name: str, model_dir: str, *flags: str) -> Iterator[Stack]:
    """`tinkerd up` on `model_dir` with `flags` in a fresh state dir, stopped after; in the quick
    run the shared stack instead when it has every flag asked for."""
    flags = ctx.stack_flags(model_dir, flags)
    if ctx.shared is not None and ctx.shared.serves(model_dir, flags):
        yield ctx.shared.get()
        return
    with running_stack(model_dir, new_dir(ctx, name), *flags) as own:
        yield own


def seconds(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median_time(fn: Callable[[], object], n: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    return statistics.median(seconds(fn) for _ in range(n))


def in_turn(measurements: list[Callable[[], float]], rounds: int, warmup: int = 1) -> list[float]:
    """The medians of measurements taken in turn, one of each per round, so machine noise hits all
    alike; each round starts one further along, so that none always runs first (or always right
    after the same other, whose caches it then inherits)."""
    for _ in range(warmup):
        for measure in measurements:
            measure()
    n = len(measurements)
    taken = [[0.0] * n for _ in range(rounds)]
    for r in range(rounds):
        for k in range(n):
            i = (r + k) % n
            taken[r][i] = measurements[i]()
    return [statistics.median(column) for column in zip(*taken)]


def alternately(ours: Callable[[], float], raw: Callable[[], float], rounds: int,
                warmup: int = 1) -> tuple[float, float]:
    """(ours, raw) medians of two measurements taken in turn, so machine noise hits both alike."""
    ours_median, raw_median = in_turn([ours, raw], rounds, warmup)
    return ours_median, raw_median


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


_COMPARISONS = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt}


def check(ratio: float, target: str) -> bool:
    op, value = target.split()
    return _COMPARISONS[op](ratio, float(value))


def tiny_model(work_dir: str) -> str:
    path = os.path.join(work_dir, "tiny-llama")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    from harness.models import build_tiny_model
    return str(build_tiny_model(path))


def smollm2_model() -> str | None:
    """SmolLM2-135M if `tinkerd fetch-smollm2 models/smollm2` has run (README main job), else None."""
    path = os.path.join(REPO, "models", "smollm2")
    return path if os.path.isfile(os.path.join(path, "config.json")) else None


def new_dir(ctx: Context, name: str) -> str:
    return tempfile.mkdtemp(prefix=f"{name}-", dir=ctx.work_dir)


def cpu_seconds(process) -> float:
    """A psutil.Process's CPU time so far, user and system."""
    t = process.cpu_times()
    return t.user + t.system


def rss_mib(pid: int) -> float:
    import psutil
    return psutil.Process(pid).memory_info().rss / 2**20


def disk_mib(path: str) -> float:
    """Size of the files below `path`; a file deleted while it is walked (pruned) counts nothing."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except FileNotFoundError:
                pass
    return total / 2**20
