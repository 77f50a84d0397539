"""Which weights dtype this machine runs well: the one place `--dtype auto` is decided.

bfloat16 pays only where the hardware computes it natively: GPUs, and CPUs with AMX or
AVX512-BF16. Elsewhere PyTorch emulates it, an order of magnitude slower than fp32
(docs/benchmarks.md#in-the-gateway-and-every-process), so bf16 there is refused at start-up
rather than discovered mid-run.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil

from tinkerd.settings import setting

AUTO = "auto"
# CPU flags (/proc/cpuinfo) that mean native bf16 matrix math.
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


@dataclasses.dataclass(kw_only=True)
class WeightsDtypeSettings:
    """The weights dtype, one setting for trainer and sampler (one `tinkerd up` flag): equal
    dtypes give equal logprobs."""
    dtype: str = setting(AUTO, choices=[AUTO, "float32", "bfloat16", "float16"],
                         help="weights dtype of trainer and sampler alike (equal dtypes give equal logprobs): auto = "
                              "bfloat16 on GPUs and CPUs with AMX/AVX512-BF16, float32 elsewhere (tinkerd/hardware.py; "
                              "not vLLM's auto); LoRA weights stay float32")
    allow_slow_dtype: bool = setting(False, help="run an explicit 16-bit --dtype on a CPU without native bf16 "
                                                 "(refused otherwise: PyTorch emulates bf16 matmuls there)")


class DtypeRefused(ValueError):
    """An explicit dtype this machine would run far slower than float32."""


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def nvidia_driver_present() -> bool:
    """Whether CUDA could be here at all, known without importing torch (seconds)."""
    return os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi") is not None


def has_gpu() -> bool:
    if not nvidia_driver_present():
        return False
    import torch
    return torch.cuda.is_available()


_gpu_memory_fraction = 0.0


def cap_gpu_memory(fraction: float) -> None:
    """Caps this process's PyTorch allocator at `fraction` of its CUDA device (LOCAL_RANK's), so
    its cache never grows into the memory of a sampler sharing the card (launcher/gpus.py);
    0: no cap. Nothing to cap on a CPU host."""
    global _gpu_memory_fraction
    if not 0 <= fraction <= 1:
        from tinkerd.errors import UserError
        raise UserError(f"--gpu-memory-fraction must be between 0 (no cap) and 1, got {fraction:g}")
    if fraction and has_gpu():
        import torch
        torch.cuda.set_per_process_memory_fraction(fraction, int(os.environ.get("LOCAL_RANK", "0")))
        _gpu_memory_fraction = fraction


def gpu_memory_bytes(device) -> int:
    """The memory this process may use on CUDA `device`: its total, or the capped share of it."""
    import torch
    total = torch.cuda.get_device_properties(device).total_memory
    return int(total * _gpu_memory_fraction) if _gpu_memory_fraction else total


def default_device():
    """Where this process computes: its current CUDA device (a trainer rank's, set from its
    LOCAL_RANK), else the CPU."""
    import torch
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def native_bf16(flags: frozenset[str] | None = None, gpu: bool | None = None) -> bool:
    flags = cpu_flags() if flags is None else flags
    if any(f in flags for f in BF16_CPU_FLAGS):
        return True
    return has_gpu() if gpu is None else gpu


def resolve_dtype(requested: str, *, flags: frozenset[str] | None = None, gpu: bool | None = None,
                  allow_slow: bool = False) -> str:
    """The dtype to run: `auto` is bfloat16 where it is native and float32 elsewhere; an explicit
    16-bit dtype without native support is refused unless `allow_slow`."""
    native = native_bf16(flags, gpu)
    if requested == AUTO:
        return "bfloat16" if native else "float32"
    if requested in ("bfloat16", "float16") and not native and not allow_slow:
        raise DtypeRefused(
            f"--dtype {requested}: this CPU has no native bf16/fp16 math (no {' or '.join(BF16_CPU_FLAGS)} flag, no "
            f"GPU); PyTorch emulates its matmuls, an order of magnitude slower than float32 (tinkerd's trainer "
            f"widens them to fp32 kernels; the sampler's speed there is not measured). Use "
            f"--dtype auto or float32, or pass --allow-slow-dtype to run it anyway.")
    return requested
