"""A sampler replica's settings: the one place their defaults are written (flags derive from here)."""

from __future__ import annotations

import dataclasses

from tinkerd.hardware import WeightsDtypeSettings
from tinkerd.metrics import MetricsSettings
from tinkerd.rpc import ServerAuthSettings
from tinkerd.settings import setting


# vLLM's own default --gpu-memory-utilization, for an engine with its GPUs to itself.
ALONE_GPU_MEMORY_UTILIZATION = 0.9


@dataclasses.dataclass
class SamplerSettings(ServerAuthSettings, WeightsDtypeSettings, MetricsSettings):
    base_model: str = setting(help="local directory of the HF base model")
    listen: str = setting("127.0.0.1:0", help="gRPC address (port 0 picks a free one)")
    state_dir: str = setting("./state", help="snapshots and checkpoints are loaded only from below it "
                                             "(the gateway's and trainer's, on a shared filesystem)")
    max_model_len: int = setting(0, help="context length: prompt + max_tokens; 0: the model's own (config.json), "
                                         "less if the KV cache holds fewer tokens (the replica logs what it took)",
                                 at_least=0)
    max_loras: int = setting(4, help="LoRA snapshots active in one batch", at_least=1)
    max_cpu_loras: int = setting(64, help="LoRA snapshots resident in memory (LRU; evicted ones reload from disk)",
                                 at_least=1)
    max_lora_rank: int = setting(64, help="the largest LoRA rank a snapshot may have", at_least=1)
    max_num_seqs: int = setting(128, help="sequences in one engine batch (vLLM's --max-num-seqs; 128 is vLLM's "
                                          "own for a CPU server: an RL step's 16 x 8 rollouts in one batch; "
                                          "a GPU takes more)", at_least=1)
    # vLLM's scale knobs for a GPU pool, passed through to its engine arguments.
    tensor_parallel_size: int = setting(1, help="GPUs one replica's engine spans (vLLM's --tensor-parallel-size); "
                                                "on CPU only 1 (refused at start-up otherwise)", at_least=1)
    gpu_memory_utilization: float = setting(0.0, help="share of each GPU's memory the engine may take for weights "
                                                      "and KV cache (vLLM's --gpu-memory-utilization); 0: 0.9, or "
                                                      "where `tinkerd up` puts it on the trainer's GPU, its split of "
                                                      "the card (docs/gpu.md); on CPU the KV cache is "
                                                      "VLLM_CPU_KVCACHE_SPACE GiB instead")
    kv_cache_mib: int = setting(0, help="the engine's KV cache in MiB (vLLM's --kv-cache-memory-bytes; each merged "
                                        "slot's engine has one too); 0: VLLM_CPU_KVCACHE_SPACE GiB on CPU (1 "
                                        "unless set), what --gpu-memory-utilization leaves on a GPU. A CPU engine "
                                        "zeroes its cache at start (~3 s per GiB on a 2-core VM)", at_least=0)
    kv_block_tokens: int = setting(0, help="tokens per KV-cache block (vLLM's --block-size): prefixes are shared "
                                           "in whole blocks, so an RL group's samples share a prompt only past "
                                           "one; 0: 32 on CPU (vLLM's CPU default is 128), vLLM's choice on a GPU",
                                   at_least=0)
    register_with: list[str] = setting([], help="URL of a gateway's internal listener (its --internal-port) to "
                                                "join the sampler pool of (repeatable); the replica heart-beats "
                                                "there with the service token and leaves on a clean stop")
    register_ca: str = setting("", help="PEM CA bundle, or the gateway's own certificate, that an https "
                                        "--register-with is verified against (default: the system's CAs)")
    advertise_address: str = setting("", help="host:port the gateways and trainer reach this replica at "
                                              "(default: the port it listens on at 127.0.0.1 for a loopback "
                                              "--listen, else at this host's IP as its hostname resolves)")
    # Merged serving of hot snapshots (sampler_service/merged.py has the whole policy).
    merged_slots: int = setting(-1, help="snapshots served from merged weights (W + scale*B@A), each in a vLLM "
                                         "engine of its own created on its first promotion; 0 turns it off; "
                                         "-1 (default): 1 in float32, 0 in bfloat16/float16, whose merged "
                                         "weights round small adapter deltas away (logprobs then differ from "
                                         "the trainer's beyond the bf16 tolerance: docs/multi-tenancy.md)", at_least=-1)
    merge_window: int = setting(32, help="merged serving looks at the last N sample requests", at_least=1)
    merge_share: float = setting(0.5, help="a snapshot whose requests asked for at least this share of the "
                                           "window's tokens is served merged; under half of it, through LoRA "
                                           "again (0 with --merge-min-requests 1: the first snapshot sampled)")
    merge_min_requests: int = setting(4, help="requests a snapshot needs in the window to be promoted", at_least=1)
    merge_wait_s: float = setting(20.0, help="a request for a snapshot being merged (promoted, or the newest of "
                                             "a training run whose previous snapshot was served merged) waits "
                                             "up to this long for its merged weights, then runs through LoRA; "
                                             "0: never waits", at_least=0)
