"""Where `tinkerd up` puts its services on a GPU host, and how services sharing a card split it.

The commonest self-hosted setup is one workstation GPU: the trainer and the sampler on one card.
vLLM takes `--gpu-memory-utilization` (0.9 by default) of the card's *total* memory and refuses
to start when less is free; and its start-up profile assumes no other process changes its memory
meanwhile (vllm/v1/worker/gpu_worker.py: "we assume the other processes using the same GPU did
not change their memory usage during the profiling"), so a trainer loading its model beside it
shrinks or breaks its KV cache. So `up`:

- gives each service GPUs of its own where there are enough (CUDA_VISIBLE_DEVICES per child:
  the trainer's ranks first, then each replica's --tensor-parallel-size), and nothing is shared;
- else places the replicas round-robin after the trainer's GPUs and splits a shared card: each
  side first gets room for its own copy of the weights and its CUDA context, and what is left goes
  SAMPLER_SHARE to the samplers' KV caches and the rest to the trainer's activations; an explicit
  --gpu-memory-utilization is checked against the card instead;
- caps the trainer's PyTorch allocator at what the samplers leave (the trainer's
  --gpu-memory-fraction), so its cache never grows into their share and a sampler restarted
  later still finds its memory free;
- starts services that share a card one after another, each once the one before is READY
  (a sampler prints READY after its engine has taken its memory).

`plan` is a pure function of the GPUs, the services and the weights' size; `place` probes the
host (in a child process: no CUDA context is left in `up`) and reads the checkpoint's headers.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import subprocess
import sys

from sampler_service.settings import ALONE_GPU_MEMORY_UTILIZATION
from tinkerd.errors import UserError

GIB = 1 << 30
# Per CUDA process: its context and libraries' workspaces (cuBLAS, NCCL), outside any budget.
CONTEXT_BYTES = 1 * GIB
# A shared card's memory beyond the weights: this share to the samplers' KV caches, the rest to
# the trainer's activations (at 8 x 512 tokens a 1B model's fp32 logits alone are 2.1 GB).
SAMPLER_SHARE = 0.4
# Below this much beyond weights and contexts a shared card cannot hold both sides.
MIN_SPARE_BYTES = 4 * GIB


@dataclasses.dataclass(frozen=True)
class Gpu:
    name: str            # as CUDA_VISIBLE_DEVICES names it for `up`: an index or a UUID
    total_bytes: int


@dataclasses.dataclass(frozen=True)
class Placement:
    devices: dict[str, list[str]]          # child ("trainer", "sampler", "sampler-2") -> its CUDA_VISIBLE_DEVICES
    utilization: dict[str, float]          # sampler replica -> its --gpu-memory-utilization
    trainer_fraction: float                # the trainer's --gpu-memory-fraction (0: uncapped)
    shared: bool                           # a card holds several services: they start one by one
    summary: str                           # what `up` prints

    def start_order(self, names: list[str]) -> list[list[str]]:
        """Groups of children started together, each group once the one before is READY."""
        return [[n] for n in names] if self.shared else [list(names)]

    def overrides(self, name: str) -> dict:
        """The settings `up` gives this child for its place."""
        if name == "trainer":
            return {"gpu_memory_fraction": self.trainer_fraction} if self.trainer_fraction else {}
        return {"gpu_memory_utilization": self.utilization[name]} if name in self.utilization else {}

    def env(self, name: str) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": ",".join(self.devices[name])} if name in self.devices else {}


def plan(gpus: list[Gpu], *, trainer_ranks: int, replicas: list[str], tensor_parallel_size: int,
         weights_bytes: int, utilization: float = 0.0) -> Placement | None:
    """The placement of the trainer's ranks and the sampler `replicas` (child names) on `gpus`;
    None without GPUs. `utilization`: the user's --gpu-memory-utilization, 0 if not given.
    Raises UserError where the services cannot fit, saying what would."""
    if not gpus:
        return None
    n, tp = len(gpus), tensor_parallel_size
    if trainer_ranks > n:
        raise UserError(f"--trainer-ranks {trainer_ranks} needs a GPU per rank; this host shows {n} "
                        f"(CUDA_VISIBLE_DEVICES)")
    if tp > n:
        raise UserError(f"--tensor-parallel-size {tp} needs that many GPUs; this host shows {n}")
    placed: dict[str, list[int]] = {"trainer": list(range(trainer_ranks))}
    alone = trainer_ranks + len(replicas) * tp <= n
    for i, name in enumerate(replicas):
        start = trainer_ranks + i * tp
        placed[name] = [(start + j) % n for j in range(tp)]
    if alone:
        util = {name: utilization or ALONE_GPU_MEMORY_UTILIZATION for name in replicas}
        lines = [f"trainer on GPU {_names(gpus, placed['trainer'])}"]
        lines += [f"{name} on GPU {_names(gpus, placed[name])} (--gpu-memory-utilization {util[name]:g})"
                  for name in replicas]
        return Placement({k: [gpus[i].name for i in v] for k, v in placed.items()}, util, 0.0, False,
                         "GPUs: each service has its own: " + "; ".join(lines))

    util = {name: 1.0 for name in replicas}
    trainer_fraction, notes = 1.0, []
    for d, gpu in enumerate(gpus):
        on_card = [name for name in replicas if d in placed[name]]
        if not on_card:
            continue
        if d in placed["trainer"]:
            each, cap = _with_trainer(gpu, len(on_card), weights_bytes, weights_bytes // tp, utilization)
            trainer_fraction = min(trainer_fraction, cap)
            notes.append(f"GPU {gpu.name} ({_gib(gpu.total_bytes)} GiB): the trainer, its allocator capped at {cap:g} "
                         f"(--gpu-memory-fraction), and {_at(on_card, each)}")
        else:
            each = _samplers_only(gpu, len(on_card), utilization)
            notes.append(f"GPU {gpu.name}: {_at(on_card, each)}")
        for name in on_card:
            util[name] = min(util[name], each)
    return Placement({k: [gpus[i].name for i in v] for k, v in placed.items()}, util,
                     0.0 if trainer_fraction == 1.0 else trainer_fraction, True,
                     "GPUs shared (services on one card start one after another): " + "; ".join(notes))


def _with_trainer(gpu: Gpu, k: int, trainer_weights: int, sampler_weights: int, utilization: float
                  ) -> tuple[float, float]:
    """Each of `k` replicas' utilization on the trainer's card, and the trainer's cap there."""
    total = gpu.total_bytes
    spare = total - trainer_weights - k * sampler_weights - (k + 1) * CONTEXT_BYTES
    if spare < MIN_SPARE_BYTES:
        raise UserError(
            f"GPU {gpu.name} ({_gib(total)} GiB) cannot hold the trainer and {k} sampler replica(s): the base "
            f"model's weights ({_gib(trainer_weights)} GiB in this dtype) once for the trainer and once per replica "
            f"leave {_gib(max(spare, 0))} GiB for activations and KV cache (at least {_gib(MIN_SPARE_BYTES)} "
            f"needed). Give the sampler GPUs of its own (more GPUs in CUDA_VISIBLE_DEVICES, or a separate "
            f"`tinkerd sampler`, deploy/), fewer --sampler-replicas, a 16-bit --dtype or a smaller model")
    if utilization:
        left = total * (1 - k * utilization) - trainer_weights - CONTEXT_BYTES
        if left < MIN_SPARE_BYTES / 2:
            most = (total - trainer_weights - CONTEXT_BYTES - MIN_SPARE_BYTES / 2) / (k * total)
            raise UserError(f"--gpu-memory-utilization {utilization:g} for {k} sampler replica(s) on the trainer's "
                            f"GPU {gpu.name} ({_gib(total)} GiB) leaves the trainer {_gib(max(left, 0))} GiB beside its "
                            f"weights ({_gib(trainer_weights)} GiB); give at most {max(most, 0):.2f}, or leave it "
                            f"unset and `tinkerd up` splits the card")
        each = utilization
    else:
        each = _round_down(k * (sampler_weights + CONTEXT_BYTES) + SAMPLER_SHARE * spare, k * total)
    return each, _round_down(total * (1 - k * each) - CONTEXT_BYTES, total)


def _samplers_only(gpu: Gpu, k: int, utilization: float) -> float:
    """Each of `k` replicas' utilization on a card without the trainer: vLLM's usual share, split."""
    if not utilization:
        return _round_down(ALONE_GPU_MEMORY_UTILIZATION, k)
    if k * utilization > 0.95:
        raise UserError(f"--gpu-memory-utilization {utilization:g} for each of the {k} sampler replicas on GPU "
                        f"{gpu.name} adds up to {k * utilization:.2f} of it; give at most {0.95 / k:.2f}, or leave "
                        f"it unset and `tinkerd up` splits the card")
    return utilization


def _round_down(part: float, whole: float) -> float:
    """part / whole to two decimals, rounded down (a share never exceeds what it was computed from)."""
    return int(100 * part / whole) / 100


def _at(replicas: list[str], each: float) -> str:
    return f"{', '.join(replicas)} at {each:g}{' each' if len(replicas) > 1 else ''} (--gpu-memory-utilization)"


def _names(gpus: list[Gpu], indices: list[int]) -> str:
    return ",".join(gpus[i].name for i in indices)


def _gib(n: float) -> str:
    return f"{n / GIB:.1f}"


# ---- the host ---------------------------------------------------------------------------------

_PROBE = ("import json, torch\n"
          "n = torch.cuda.device_count() if torch.cuda.is_available() else 0\n"
          "print(json.dumps([torch.cuda.get_device_properties(i).total_memory for i in range(n)]))\n")


def visible_gpus(environ=os.environ) -> list[Gpu]:
    """The GPUs this process may use, named as its CUDA_VISIBLE_DEVICES names them. Probed in a
    child process, so `up` itself holds no CUDA context; nothing is probed on a host plainly
    without an NVIDIA driver."""
    from tinkerd import hardware

    if not hardware.nvidia_driver_present():
        return []
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120,
                             check=True, env=dict(environ)).stdout
        totals = json.loads(out.strip().splitlines()[-1])
    except (subprocess.SubprocessError, OSError, ValueError, IndexError) as e:
        print(f"tinkerd: could not list the GPUs ({e}); the services choose their devices themselves",
              file=sys.stderr, flush=True)
        return []
    listed = [s.strip() for s in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if s.strip()]
    names = listed[:len(totals)] if len(listed) >= len(totals) else [str(i) for i in range(len(totals))]
    return [Gpu(name, total) for name, total in zip(names, totals)]


def weights_bytes(model_dir: str, dtype: str) -> int:
    """The base model's weights in memory at `dtype` (float tensors; integer ones as stored), from
    the checkpoint's safetensors headers; other formats by their files' sizes."""
    from tinkerd import dtypes
    from tinkerd.merged_export import ITEMSIZE, read_header

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        return sum(os.path.getsize(f) for f in glob.glob(os.path.join(model_dir, "*.bin")))
    width = ITEMSIZE[dtypes.by_name(dtype).safetensors]
    total = 0
    for file in files:
        for info in read_header(file).values():
            count = 1
            for d in info["shape"]:
                count *= d
            stored = info["dtype"]
            total += count * (width if stored.startswith(("F", "BF")) else ITEMSIZE.get(stored, 4))
    return total


def place(args, replicas: list[str]) -> Placement | None:
    """`up`'s placement of its children on this host's GPUs (None on a host without any)."""
    gpus = visible_gpus()
    placement = plan(gpus, trainer_ranks=args.trainer_ranks, replicas=replicas,
                     tensor_parallel_size=args.tensor_parallel_size,
                     weights_bytes=weights_bytes(args.base_model, args.dtype) if gpus else 0,
                     utilization=args.gpu_memory_utilization or 0.0)
    if placement and placement.trainer_fraction and args.gpu_memory_fraction:      # the smaller cap holds
        placement = dataclasses.replace(placement, trainer_fraction=min(placement.trainer_fraction,
                                                                        args.gpu_memory_fraction))
    return placement

