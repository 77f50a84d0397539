"""DeepSpeed plumbing: the default process group, the ZeRO stage the engines run, the engine
config, and one engine per adapter."""

from __future__ import annotations

import os
import sys

import torch

from tinkerd.optimizers import ADAMW, DIMUON
from trainer_service.dimuon import Dimuon
from trainer_service.lora import AdapterModule


def init_distributed_once() -> None:
    """DeepSpeed's default group; a single process unless started by a launcher (torchrun, the
    deepspeed launcher), whose environment (RANK, WORLD_SIZE, MASTER_ADDR, ...) it then joins."""
    import deepspeed
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if torch.cuda.is_available():         # one GPU per rank on its host
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        # On CPU DeepSpeed JIT-compiles a shared-memory allreduce op at init (35-85 s on a
        # fresh machine). gloo does every collective just as well for our sizes.
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "MASTER_PORT" not in os.environ and os.environ["WORLD_SIZE"] == "1":
        # One rank started on its own: an in-memory store, no port. (A free port picked by bind
        # and close can be taken by another process before the store listens on it: EADDRINUSE.)
        # DeepSpeed then adopts this group.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend=backend)


def effective_zero_stage(configured: int, world: int) -> int:
    """The ZeRO stage the adapter engines run. On one rank stages 1 and 2 partition nothing and
    only cost (gradient buckets, a reduction micro-step per optim_step): they run as stage 0,
    whose gradients are plain .grad. Several ranks keep the configured stage; stage 3 stays 3."""
    if world == 1 and configured in (1, 2):
        return 0
    return configured


def deepspeed_config(zero_stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        # A window that never closes by count: optim_step closes it explicitly.
        "gradient_accumulation_steps": 1 << 30,
        "zero_allow_untested_optimizer": True,
        # optim_step clips to each request's grad_clip_norm; DeepSpeed's default (1.0) would
        # clip every stage-0 step again, with a collective (a ZeRO optimizer's is overridden).
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": zero_stage},
        "steps_per_print": 1 << 30,
    }


def model_zero_stage(job_stage: int, optimizer: str) -> int:
    """The ZeRO stage a model's engine runs: the job's, but stage 0 for a Dimuon model under
    ZeRO-1/2, whose matrix-sign step needs each LoRA matrix's gradient and momentum whole (its
    momentum is then held whole on every rank, the step taken alike on each). ZeRO-3 partitions
    the parameters themselves: no Dimuon model there (ModelRegistry.check_spec)."""
    return 0 if optimizer == DIMUON and job_stage in (1, 2) else job_stage


def adapter_engine(peft_model, adapter_name: str, params: list[torch.nn.Parameter], zero_stage: int,
                   optimizer: str = ADAMW, rank: int = 0):
    """A DeepSpeed engine around one adapter's parameters, with its own optimizer (AdamW, or
    Dimuon for a model of LoRA rank `rank`: state, gradients and step count never mix between
    adapters), its accumulation window open."""
    import deepspeed

    if optimizer == DIMUON:
        step = Dimuon(params, rank)
    else:
        # One fused kernel, on CUDA and on CPU (PyTorch's CPU default is a per-tensor loop; foreach
        # is ~12 ops per tensor: a tiny model's 30 LoRA tensors stepped in 1.0 ms that way, 0.4 fused).
        step = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0, fused=True)
    engine, *_ = deepspeed.initialize(model=AdapterModule(peft_model, adapter_name, params),
                                      optimizer=step, config=deepspeed_config(zero_stage))
    engine.set_gradient_accumulation_boundary(False)
    return engine
