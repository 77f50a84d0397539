"""Prometheus metrics after a real SDK run on the shared stack: the gateway's /metrics (on its
own port, no API key) and the trainer's and sampler's --metrics-port, found the way Prometheus
finds them (<state-dir>/prometheus-targets.json); and the Grafana dashboard only queries
metrics a real scrape has. One test: the stack is shared, CI time is not."""

from __future__ import annotations

import json
import os
import pathlib
import re
import urllib.request

import pytest
import tinker
from prometheus_client.parser import text_string_to_metric_families
from tinker import types

from conftest import sft_data

pytestmark = pytest.mark.e2e

DASHBOARD = pathlib.Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "tinkerd.json"


def _scrape(url: str) -> list:
    """Every sample of a scrape as (name, labels, value), and (family name, {}, None) for each
    family (a gauge family may have no samples: queue depths of an idle gateway)."""
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        text = r.read().decode()
    families = list(text_string_to_metric_families(text))
    return [(s.name, s.labels, s.value) for f in families for s in f.samples] + [(f.name, {}, None) for f in families]


def _value(samples: list, name: str, **labels) -> float:
    """The sum over samples named `name` whose labels include `labels`."""
    return sum(v for n, ls, v in samples
               if n == name and v is not None and all(ls.get(k) == w for k, w in labels.items()))


def _scrape_all(urls: dict) -> dict:
    return {service: _scrape(url) for service, url in urls.items()}


def test_counters_after_an_sdk_run_and_the_dashboard_queries_real_metrics(stack, tiny_model_dir):
    with open(os.path.join(stack.state_dir, "prometheus-targets.json")) as f:
        targets = json.load(f)
    urls = {t["labels"]["service"]: f"http://{t['targets'][0]}/metrics" for t in targets}
    assert set(urls) == {"gateway", "trainer", "sampler"}
    before = _scrape_all(urls)

    tc = tinker.ServiceClient(base_url=stack.url).create_lora_training_client(
        base_model=tiny_model_dir, rank=8, seed=0).result()
    tok = tc.get_tokenizer()
    data = sft_data(tok, ["the cat sat on a mat", "one two three four five"])
    trained_tokens = sum(d.model_input.length for d in data)
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    reply = sampler.sample(types.ModelInput.from_ints(tok.encode("the cat")), 1,
                           types.SamplingParams(max_tokens=5, temperature=1.0, seed=1)).result()
    sampled_tokens = sum(len(s.tokens) for s in reply.sequences)
    assert sampled_tokens > 0
    after = _scrape_all(urls)

    def delta(service: str, name: str, **labels) -> float:
        return _value(after[service], name, **labels) - _value(before[service], name, **labels)

    # Gateway: requests by route template and status, tokens, a snapshot push, pending futures.
    assert delta("gateway", "tinkerd_gateway_requests_total", route="/api/v1/forward_backward", status="200") >= 1
    assert delta("gateway", "tinkerd_gateway_requests_total", route="/api/v1/asample", status="200") >= 1
    assert delta("gateway", "tinkerd_gateway_request_duration_seconds_count", route="/api/v1/optim_step") >= 1
    routes = {ls["route"] for n, ls, v in after["gateway"] if n == "tinkerd_gateway_requests_total" and v is not None}
    assert all(r.startswith("/") or r == "(unmatched)" for r in routes), routes
    assert not any(tc.model_id in r for r in routes), "a raw path leaked into the route label"
    assert delta("gateway", "tinkerd_gateway_tokens_total", kind="trained") == trained_tokens
    assert delta("gateway", "tinkerd_gateway_tokens_total", kind="sampled") == sampled_tokens
    assert delta("gateway", "tinkerd_gateway_snapshot_push_duration_seconds_count") == 1
    assert delta("gateway", "tinkerd_gateway_snapshot_push_bytes_total") > 0
    assert {ls["type"] for n, ls, v in after["gateway"] if n == "tinkerd_gateway_futures_pending" and v is not None} >= {
        "forward_backward", "optim_step", "sample"}

    # Trainer: engine step times, trained tokens, the push, resident models.
    assert delta("trainer", "tinkerd_trainer_step_duration_seconds_count", kind="forward_backward") == 1
    assert delta("trainer", "tinkerd_trainer_step_duration_seconds_count", kind="optim_step") == 1
    assert delta("trainer", "tinkerd_trainer_tokens_total", kind="forward_backward") == trained_tokens
    assert delta("trainer", "tinkerd_trainer_weight_pushes_total") == 1
    assert delta("trainer", "tinkerd_trainer_weight_push_bytes_total") == delta(
        "gateway", "tinkerd_gateway_snapshot_push_bytes_total")
    assert _value(after["trainer"], "tinkerd_trainer_resident_models") >= 1
    assert delta("trainer", "tinkerd_rpc_duration_seconds_count", method="ForwardBackward", code="OK") >= 1

    # Sampler: the sample's engine time and tokens, the streamed snapshot.
    assert delta("sampler", "tinkerd_sampler_sample_duration_seconds_count") == 1
    assert delta("sampler", "tinkerd_sampler_requests_total", engine="lora") == 1
    assert delta("sampler", "tinkerd_sampler_tokens_total", kind="sampled") == sampled_tokens
    assert delta("sampler", "tinkerd_sampler_engine_step_duration_seconds_count") >= 1
    assert delta("sampler", "tinkerd_sampler_snapshot_loads_total", source="stream") == 1
    assert delta("sampler", "tinkerd_rpc_duration_seconds_count", method="Sample", code="OK") >= 1

    # Every process reports its memory (prometheus_client's process collector).
    for service in urls:
        assert _value(after[service], "process_resident_memory_bytes") > 10e6, service

    # The dashboard queries only metric names a real scrape has.
    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p.get("targets", ())]
    queried = {m for e in exprs for m in re.findall(r"\b((?:tinkerd|process)_[a-z_]+)", e)}
    scraped = {n for samples in after.values() for n, _, _ in samples}
    assert len(queried) > 15 and not queried - scraped, sorted(queried - scraped)
