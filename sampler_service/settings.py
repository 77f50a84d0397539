"""A sampler replica's settings: the one place their defaults are written (flags derive from here)."""

from __future__ import annotations

import dataclasses

from tinkerd.rpc import ServerAuthSettings
from tinkerd.settings import setting


@dataclasses.dataclass
class SamplerSettings(ServerAuthSettings):
    base_model: str = setting(help="local directory of the HF base model")
    listen: str = setting("127.0.0.1:0", help="gRPC address (port 0 picks a free one)")
    state_dir: str = setting("./state", help="snapshots and checkpoints are loaded only from below it "
                                             "(the gateway's and trainer's, on a shared filesystem)")
    dtype: str = setting("auto", choices=["auto", "float32", "bfloat16", "float16"],
                         help="weights dtype, the trainer's (equal dtypes give equal logprobs): auto = bfloat16 on "
                              "GPUs and CPUs with AMX/AVX512-BF16, float32 elsewhere (not vLLM's auto)")
    allow_slow_dtype: bool = setting(False, help="run an explicit 16-bit --dtype on a CPU without native bf16 "
                                                 "(refused otherwise: ~15x slower than float32 there)")
    max_model_len: int = setting(1024, help="context length: prompt + max_tokens")
    max_loras: int = setting(4, help="LoRA snapshots active in one batch")
    max_cpu_loras: int = setting(64, help="LoRA snapshots resident in memory (LRU; evicted ones reload from disk)")
    max_lora_rank: int = setting(64, help="the largest LoRA rank a snapshot may have")
    max_num_seqs: int = setting(64, help="sequences in one engine batch")
