"""The trainer's settings: the one place their defaults are written (flags derive from here)."""

from __future__ import annotations

import dataclasses

from tinkerd.hardware import WeightsDtypeSettings
from tinkerd.metrics import MetricsSettings
from tinkerd.rpc import ServerAuthSettings
from tinkerd.settings import setting
from tinkerd.weight_transport import PREFERENCE
from trainer_service.durable import IDLE_WRITE_AFTER_S


@dataclasses.dataclass
class TrainerSettings(ServerAuthSettings, WeightsDtypeSettings, MetricsSettings):
    base_model: str = setting(help="local directory of the HF base model")
    aliases: list[str] = setting([], flag="alias", help="another name clients may use for the base model")
    listen: str = setting("127.0.0.1:0", help="gRPC address (port 0 picks a free one)")
    advertise_host: str = setting("", help="host samplers connect to for weight streaming (the stream's store "
                                           "and gloo listen on this interface only); default: --listen's host "
                                           "(127.0.0.1 for loopback; for 0.0.0.0, this host's address as its "
                                           "hostname resolves); refused at start unless it is this host's")
    state_dir: str = setting("./state", help="checkpoints, snapshots and models' durable state; every path is "
                                             "derived below it from ids (the gateway's, on a shared filesystem)")
    zero_stage: int = setting(2, choices=[0, 1, 2, 3], help="DeepSpeed ZeRO stage (on one rank 1 and 2 run as 0: "
                                                            "nothing to partition)")
    max_lora_rank: int = setting(64, help="the largest LoRA rank a model may have", at_least=1)
    durable_interval_s: float = setting(10.0, help="write a model's durable state after an optim_step once its "
                                                   "last write is older than this, right after its reply (0: every "
                                                   "step, before its reply); also written when the trainer is "
                                                   "idle, and on unload", at_least=0)
    durable_idle_s: float = setting(IDLE_WRITE_AFTER_S, help="write the durable state of models that are behind once the trainer "
                                              "has been idle this long (0: not when idle; after optim_steps by "
                                              "--durable-interval-s and on unload still)", at_least=0)
    max_batch_tokens: int = setting(1 << 17, help="a forward_backward's datums x its longest datum (the trainer "
                                                  "pads every datum to the longest): more is a 400", at_least=1)
    max_logits_mib: int = setting(0, help="fp32 logits a forward_backward holds at once (batch tokens x "
                                          "vocabulary x 4 bytes); a larger batch goes through the unembedding "
                                          "in chunks recomputed in the backward: bounded memory for one more "
                                          "lm_head forward (0: 1024 on a CPU; on a GPU an eighth of "
                                          "--activation-mib's budget, at least 1024)", at_least=0)
    activation_mib: int = setting(0, help="activations a forward_backward keeps for its backward at once (measured "
                                          "per token at start-up); a larger batch goes through forward and backward "
                                          "in micro-batches whose gradients add up; the step's peak is about "
                                          "twice this (0: a quarter of the GPU's memory, a sixteenth of the "
                                          "host's)", at_least=0)
    gpu_memory_fraction: float = setting(0.0, help="the most of its GPU's memory the trainer's allocator may hold "
                                                   "(torch's per-process memory fraction), so a sampler sharing the "
                                                   "card keeps its share; 0: no cap. `tinkerd up` sets it where a "
                                                   "sampler shares the trainer's GPU (docs/gpu.md)")
    max_resident_models: int = setting(32, help="models kept in memory; the least recently used others wait "
                                                "on disk and reload on their next use", at_least=1)
    weight_transports: list[str] = setting([], flag="weight-transport", choices=list(PREFERENCE),
                                           help="a way weights may travel to a sampler replica, repeatable "
                                                "(default: all; each replica gets the cheapest both ends can "
                                                "use: cuda_ipc, nccl, shm, gloo); e.g. gloo where containers "
                                                "share a host name but not /dev/shm")
    rank_timeout_s: float = setting(30.0, help="a job of several ranks: a rank not heard from this long (its host "
                                               "cut off, its process stuck or gone) breaks the job; the call in "
                                               "flight fails, health says NOT_SERVING and the ranks exit, to be "
                                               "restarted. Each rank checks in with the job's store (MASTER_ADDR) "
                                               "several times in this", at_least=1)
    master_timeout_s: float = setting(120.0, help="a job of several ranks: how long a rank other than 0 waits at "
                                                  "start for MASTER_ADDR:MASTER_PORT (the job's store) to answer "
                                                  "before it exits naming it", at_least=1)
