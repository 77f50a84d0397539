"""The arithmetic behind the session panels and the trace (gateway/traces/session_metrics.py,
gateway/traces/pftrace.py) on hand-made spans: percentiles, time buckets, step times, lanes."""

from __future__ import annotations

import types

import pytest

from gateway.traces import pftrace, session_metrics


def _span(kind, received, started, finished, *, service="trainer", model="s:train:0", tokens_in=0, tokens_out=0,
          status="complete", request_id="r"):
    return types.SimpleNamespace(kind=kind, received_us=received, started_us=started, finished_us=finished,
                                 service=service, model_id=model, tokens_in=tokens_in, tokens_out=tokens_out,
                                 status=status, request_id=request_id, detail="", span_id=received)


def test_percentiles_are_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert [session_metrics.percentile(values, q) for q in (50, 90, 99, 100)] == [50.0, 90.0, 99.0, 100.0]
    assert session_metrics.percentile([7.0], 99) == 7.0
    spans = [_span("sample", 0, 0, ms * 1000, service="sampler a") for ms in (10, 20, 30, 40)]
    assert session_metrics.latency(spans)["sample"] == {"count": 4, "p50_s": 0.02, "p90_s": 0.04, "p99_s": 0.04,
                                                         "max_s": 0.04}


def test_panels_spread_tokens_and_busy_time_over_one_second_points():
    s = 1_000_000
    spans = [_span("forward_backward", 0, 0, s, tokens_in=100),             # busy all of second 0
             _span("optim_step", s, s, s + s // 2),                          # half of second 1
             _span("sample", 0, s // 2, 3 * s, service="sampler a", tokens_in=10, tokens_out=50, model=None),
             types.SimpleNamespace(kind="rate_limited", received_us=2 * s, started_us=None, finished_us=2 * s,
                                   service="", model_id=None, tokens_in=0, tokens_out=0, status="refused",
                                   request_id=None, detail="sample: over", span_id=9)]
    p = session_metrics.panels(spans, in_flight_now=2)
    assert p["bucket_s"] == 1.0 and p["requests"] == 3 and p["rate_limited"] == 1
    assert p["training_utilization"]["series"] == [[0.0, 1.0], [1.0, 0.5], [2.0, 0.0], [3.0, 0.0]]
    assert p["tokens_per_s"]["training"][0] == [0.0, 100.0]
    assert sum(v for _, v in p["tokens_per_s"]["generation"]) == pytest.approx(50)
    assert p["tokens_per_s"]["generation"][0] == [0.0, 10.0]        # 0.5 s of its 2.5 s run in second 0
    assert p["in_flight_samples"] == {"now": 2, "series": [[0.0, 1.0], [1.0, 1.0], [2.0, 1.0], [3.0, 0.0]]}
    assert p["step_times"] == [{"model_id": "s:train:0", "points": [[1, 1.5]]}]
    assert session_metrics.panels([], 0)["in_flight_samples"] == {"now": 0, "series": []}


def test_overlapping_requests_of_a_service_get_lanes_that_never_overlap():
    spans = [_span("sample", 0, 0, 10, service="a"), _span("sample", 5, 5, 20, service="a"),
             _span("sample", 10, 10, 12, service="a"), _span("sample", 11, 11, 30, service="a"),
             _span("forward", 5, 5, 9)]
    lanes = pftrace._lanes(spans)
    assert lanes == [0, 1, 2, 0, 0]       # lane 0 is free again after 10 (strictly): the 4th takes it
    for lane in set(lanes):
        on = sorted((s.received_us, s.finished_us) for s, l in zip(spans, lanes) if l == lane and s.service == "a")
        assert all(prev[1] < nxt[0] for prev, nxt in zip(on, on[1:]))
