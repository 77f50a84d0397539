"""A sampler replica's Prometheus metrics (served with --metrics-port, tinkerd/metrics.py), next
to vLLM's own `vllm:` metrics in the same registry."""

from __future__ import annotations

import time

from prometheus_client import Counter, Gauge, Histogram

from tinkerd.metrics import DURATION_BUCKETS

SAMPLE_SECONDS = Histogram("tinkerd_sampler_sample_duration_seconds", "one Sample request in the engine, "
                           "from its admission to its last sequence finishing (batched with others)",
                           buckets=DURATION_BUCKETS)
ENGINE_STEP_SECONDS = Histogram("tinkerd_sampler_engine_step_duration_seconds", "one vLLM engine step (a "
                                "batch of sequences, one token each, or a prefill)",
                                buckets=(0.0005, *DURATION_BUCKETS))
TOKENS = Counter("tinkerd_sampler_tokens_total", "tokens by kind: prompt (prefilled per request) and "
                 "sampled (generated, all sequences)", ["kind"])
SNAPSHOTS = Gauge("tinkerd_sampler_snapshots", "LoRA snapshots this replica can serve (registered; vLLM's "
                  "LRU cache holds up to --max-cpu-loras of them in memory and reloads the others)")
SNAPSHOT_LOADS = Counter("tinkerd_sampler_snapshot_loads_total", "snapshots registered, by source: stream "
                         "(pushed by the trainer) or disk (its persisted copy, on first use here)", ["source"])
REQUESTS = Counter("tinkerd_sampler_requests_total", "Sample requests by the engine that ran them: base (no "
                   "snapshot), lora (the multi-LoRA engine) or merged (a merged slot: no LoRA ops)", ["engine"])
MERGE_WAIT_SECONDS = Histogram("tinkerd_sampler_merge_wait_seconds", "how long a request for a snapshot being "
                               "merged waited for its merged slot (--merge-wait-s)", buckets=DURATION_BUCKETS)
RECEIVE_SECONDS = Histogram("tinkerd_sampler_weight_receive_duration_seconds", "ReceiveWeights: join, "
                            "receive and register a pushed snapshot", buckets=DURATION_BUCKETS)


def track_sample(future, num_prompt_tokens: int) -> None:
    """Observes a Sample request's engine time and tokens when its future completes."""
    t0 = time.perf_counter()

    def done(f) -> None:
        if f.cancelled() or f.exception() is not None:
            return
        SAMPLE_SECONDS.observe(time.perf_counter() - t0)
        outputs = f.result()
        TOKENS.labels("prompt").inc(num_prompt_tokens)
        TOKENS.labels("sampled").inc(sum(len(o.outputs[0].token_ids) for o in outputs if o.outputs))
    future.add_done_callback(done)
