"""What a session's request spans (gateway/traces/spans.py) add up to: the console's session panels
(in-flight samples, training utilization, training / generation / prefill tokens per second,
step times) and the latency percentiles the trace export carries too. Pure functions of the
rows, so the console and the Perfetto file (gateway/traces/pftrace.py) agree."""

from __future__ import annotations

import math
from typing import Iterable, Sequence

MAX_BUCKETS = 120            # points per panel series
MIN_BUCKET_US = 1_000_000    # one second: finer is noise at the rates a session sees
TRAINING_KINDS = ("forward_backward", "forward")


def is_request(span) -> bool:
    return span.request_id is not None


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The nearest-rank q-th percentile (0 < q <= 100) of ascending values."""
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def latency(spans: Iterable) -> dict[str, dict]:
    """Per request kind: count and received-to-finished latency percentiles, in seconds."""
    by_kind: dict[str, list[float]] = {}
    for s in spans:
        if is_request(s):
            by_kind.setdefault(s.kind, []).append((s.finished_us - s.received_us) / 1e6)
    out = {}
    for kind, values in sorted(by_kind.items()):
        values.sort()
        out[kind] = {"count": len(values), "p50_s": percentile(values, 50), "p90_s": percentile(values, 90),
                     "p99_s": percentile(values, 99), "max_s": values[-1]}
    return out


class _Buckets:
    """Equal time buckets over [t0, t1]; `spread` adds an amount over an interval in proportion
    to its overlap with each bucket (a point interval goes to its bucket whole)."""

    def __init__(self, t0: int, t1: int):
        self.t0 = t0
        self.width = max(MIN_BUCKET_US, math.ceil((t1 - t0 + 1) / MAX_BUCKETS))
        self.n = max(1, math.ceil((t1 - t0 + 1) / self.width))

    def series(self) -> list[float]:
        return [0.0] * self.n

    def spread(self, values: list[float], start: int, end: int, amount: float) -> None:
        first = min(self.n - 1, max(0, (start - self.t0) // self.width))
        if end <= start:
            values[first] += amount
            return
        last = min(self.n - 1, max(0, (end - 1 - self.t0) // self.width))
        for b in range(first, last + 1):
            lo, hi = self.t0 + b * self.width, self.t0 + (b + 1) * self.width
            overlap = min(end, hi) - max(start, lo)
            if overlap > 0:
                values[b] += amount * overlap / (end - start)

    def points(self, values: list[float], per_second: bool = False) -> list[list[float]]:
        """[seconds since t0 at the bucket's start, value] per bucket; `per_second` divides by its width."""
        scale = 1e6 / self.width if per_second else 1.0
        return [[b * self.width / 1e6, round(v * scale, 6)] for b, v in enumerate(values)]


def step_times(spans: Iterable) -> list[dict]:
    """Per training run: the seconds each optimizer step took, from the previous optim_step's
    finish (the first: from the run's first request) to this one's."""
    first: dict[str, int] = {}
    optim: dict[str, list[int]] = {}
    for s in spans:
        if not is_request(s) or s.model_id is None or s.service != "trainer":
            continue
        first[s.model_id] = min(first.get(s.model_id, s.received_us), s.received_us)
        if s.kind == "optim_step" and s.status == "complete":
            optim.setdefault(s.model_id, []).append(s.finished_us)
    out = []
    for model_id, ends in sorted(optim.items()):
        ends.sort()
        previous = [first[model_id], *ends[:-1]]
        out.append({"model_id": model_id,
                    "points": [[i + 1, (end - prev) / 1e6] for i, (prev, end) in enumerate(zip(previous, ends))]})
    return out


def panels(spans: Sequence, in_flight_now: int) -> dict:
    """The session page's panels over the recorded spans' time range."""
    requests = [s for s in spans if is_request(s)]
    refused = [s for s in spans if not is_request(s)]
    out = {"requests": len(requests), "rate_limited": len(refused),
           "rate_limit_events": [{"at_us": s.finished_us, "detail": s.detail} for s in refused[-50:]],
           "latency": latency(requests), "step_times": step_times(requests)}
    if not spans:
        return {**out, "t0_us": None, "bucket_s": None, "in_flight_samples": {"now": in_flight_now, "series": []},
                "training_utilization": {"mean": 0.0, "series": []},
                "tokens_per_s": {"training": [], "generation": [], "prefill": []}}
    t0 = min(s.received_us for s in spans)
    t1 = max(s.finished_us for s in spans)
    buckets = _Buckets(t0, t1)
    in_flight, busy, trained, generated, prefilled = (buckets.series() for _ in range(5))
    for s in requests:
        ran_from = s.started_us if s.started_us is not None else s.finished_us
        if s.kind == "sample":
            # time-weighted count in flight: each sample adds its share of each bucket it spans
            buckets.spread(in_flight, s.received_us, s.finished_us, (s.finished_us - s.received_us) / buckets.width)
            buckets.spread(prefilled, ran_from, s.finished_us, s.tokens_in)
            buckets.spread(generated, ran_from, s.finished_us, s.tokens_out)
        elif s.service == "trainer":
            buckets.spread(busy, ran_from, s.finished_us, (s.finished_us - ran_from) / buckets.width)
            if s.kind in TRAINING_KINDS:
                buckets.spread(trained, ran_from, s.finished_us, s.tokens_in)
    busy = [min(1.0, v) for v in busy]
    return {**out, "t0_us": t0, "bucket_s": buckets.width / 1e6,
            "in_flight_samples": {"now": in_flight_now, "series": buckets.points(in_flight)},
            "training_utilization": {"mean": round(sum(busy) / len(busy), 6), "series": buckets.points(busy)},
            "tokens_per_s": {"training": buckets.points(trained, per_second=True),
                             "generation": buckets.points(generated, per_second=True),
                             "prefill": buckets.points(prefilled, per_second=True)}}
