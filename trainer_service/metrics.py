"""The trainer's Prometheus metrics (served with --metrics-port, tinkerd/metrics.py). Engine
times are the engine's own work, without the wait for a model's fair turn (that is in
tinkerd_rpc_duration_seconds)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from tinkerd.metrics import DURATION_BUCKETS

STEP_SECONDS = Histogram("tinkerd_trainer_step_duration_seconds", "engine time of one call, by kind "
                         "(forward_backward, forward, optim_step)", ["kind"], buckets=DURATION_BUCKETS)
TOKENS = Counter("tinkerd_trainer_tokens_total", "tokens through the model, by kind (forward_backward "
                 "counts trained tokens; forward counts forward-only tokens)", ["kind"])
RESIDENT_MODELS = Gauge("tinkerd_trainer_resident_models", "LoRA models in memory (the others wait on disk)")
EVICTIONS = Counter("tinkerd_trainer_evictions_total", "models unloaded to disk to make room (least recently "
                    "used first, --max-resident-models)")
RELOADS = Counter("tinkerd_trainer_reloads_total", "models brought back from disk on their next use")
PUSH_SECONDS = Histogram("tinkerd_trainer_weight_push_duration_seconds", "PushWeights from the gather to "
                         "every sampler's commit (and the persisted copy)", buckets=DURATION_BUCKETS)
PUSH_BYTES = Counter("tinkerd_trainer_weight_push_bytes_total", "adapter bytes streamed to samplers "
                     "(once per push, whatever the number of replicas)")
PUSHES = Counter("tinkerd_trainer_weight_pushes_total", "weight pushes completed")
WEIGHT_LINKS = Counter("tinkerd_trainer_weight_links_total", "links to sampler replicas formed for weight pushes, "
                       "by transport (cuda_ipc, nccl, shm, gloo; tinkerd/weight_transport.py)", ["transport"])


def tokens_of(data) -> int:
    """Token positions in a batch of training.DatumInput."""
    return sum(len(d.tokens) for d in data)


def stepped(kind: str, data, seconds: float) -> None:
    """An engine call of `kind` that ran (a resend answered with its first reply did not): its
    engine seconds, and a forward's or forward_backward's tokens (`data`, its DatumInputs)."""
    STEP_SECONDS.labels(kind).observe(seconds)
    if kind in ("forward", "forward_backward"):
        TOKENS.labels(kind).inc(tokens_of(data))


def pushed(reply, seconds: float) -> None:
    PUSHES.inc()
    PUSH_BYTES.inc(reply.num_bytes)
    PUSH_SECONDS.observe(seconds)
