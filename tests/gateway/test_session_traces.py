"""Session traces in-process (fake trainer and sampler): every request of a session is a span;
trace_export hands out a signed URL whose file is a Perfetto trace (read back with the official
schema, perfetto's perfetto_trace_pb2) with one request slice per request, the rate-limit
refusals and the latency summary; the console's session panels add the spans up; each session
keeps at most --trace-spans-per-session spans."""

from __future__ import annotations

import types
import urllib.parse

import numpy as np
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pf

from gateway import tinker_wire_pb2 as tw
from gateway.app import create_app
from gateway.storage.db import TraceSpanRow
from gateway_fakes import Api, FakeSampler, FakeTrainer, assert_user_error, fake_services

PROTOBUF = {"content-type": "application/x-protobuf"}


@pytest.fixture
def make_gateway(tmp_path):
    """A gateway on fake services with some settings changed; stopped at the test's end."""
    stack = []

    def make(**settings):
        trainer, sampler = FakeTrainer(str(tmp_path / "state")), FakeSampler()
        services = fake_services(tmp_path, trainer, sampler, **settings)
        client = TestClient(create_app(services.__enter__()))
        client.__enter__()
        stack.append((services, client))
        api = Api(client, "").as_user("tracer")
        return types.SimpleNamespace(api=api, gw=client.app.state.gateway)
    yield make
    for services, client in reversed(stack):
        client.__exit__(None, None, None)
        services.__exit__(None, None, None)


def _train(api: Api, model_id: str, seq_id: int) -> list[str]:
    req = tw.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy")
    datum = req.data.add()
    datum.model_input.add().encoded_text.tokens = np.asarray([5, 6, 7, 8], "<i4").tobytes()
    targets = datum.loss_fn_inputs["target_tokens"]
    targets.dtype, targets.dense = tw.DTYPE_INT64, np.asarray([6, 7, 8, 0], "<i8").tobytes()
    fb = api.client.post("/api/v1/forward_backward", headers={**PROTOBUF, "X-API-Key": api.api_key},
                         content=req.SerializeToString()).json()
    # Each finished before the next is sent: the gateway overlaps a model's steps (futures/order.py)
    # and this fake trainer, unlike the real one, does not hold them in seq_id order.
    assert api.result(fb).status_code == 200
    opt = api.post("optim_step", {"model_id": model_id, "seq_id": seq_id + 1,
                                  "adam_params": {"learning_rate": 0.01}}).json()
    assert api.result(opt).status_code == 200
    return [fb["request_id"], opt["request_id"]]


def _sample(api: Api, sampling_session_id: str, seq_id: int):
    return api.post("asample", {"sampling_session_id": sampling_session_id, "seq_id": seq_id, "num_samples": 2,
                                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
                                "sampling_params": {"max_tokens": 2}})


def _download(api: Api, url: str):
    """The signed URL as the SDK's CLI fetches it: a plain GET, no credentials."""
    parts = urllib.parse.urlsplit(url)
    return api.client.get(f"{parts.path}?{parts.query}", headers={"X-API-Key": ""})


def _read_trace(body: bytes) -> pf.Trace:
    trace = pf.Trace()
    trace.ParseFromString(body)
    return trace


def test_a_sessions_requests_are_one_slice_each_in_its_perfetto_trace(make_gateway):
    g = make_gateway(max_pending_samples=1_000)
    api = g.api
    session = api.session()
    model = api.model(session)
    requests = [*_train(api, model, 1), *_train(api, model, 3)]
    sampler = api.post("create_sampling_session", {"session_id": session, "sampling_session_seq_id": 0,
                                                   "base_model": "tiny/base"}).json()["sampling_session_id"]
    for seq in range(3):
        future = _sample(api, sampler, seq).json()
        assert api.result(future).status_code == 200
        requests.append(future["request_id"])
    g.gw.settings.max_pending_samples = 0          # the next sample is refused: a rate-limit event
    assert _sample(api, sampler, 3).status_code == 429
    other = api.session()                          # another session's requests are not in this trace
    api.model(other)

    export = api.get(f"sessions/{session}/trace_export")
    assert export.status_code == 200, export.json()
    assert export.json()["status"] == "ready"
    got = _download(api, export.json()["url"])
    assert got.status_code == 200, got.text
    trace = _read_trace(got.content)

    tracks = {p.track_descriptor.uuid: p.track_descriptor for p in trace.packet if p.HasField("track_descriptor")}
    events = [p for p in trace.packet if p.HasField("track_event")]
    slices = [p for p in events if p.track_event.type == pf.TrackEvent.TYPE_SLICE_BEGIN
              and list(p.track_event.categories) == ["request"]]
    args = [{a.name: a for a in p.track_event.debug_annotations} for p in slices]
    # One slice per request: create_model, 2 x (forward_backward, optim_step), 3 samples.
    assert sorted(a["request_id"].string_value for a in args) == sorted(
        [*requests, api_request_id_of_create(g, model)])
    assert sorted(p.track_event.name for p in slices) == sorted(
        ["create_model"] + ["forward_backward", "optim_step"] * 2 + ["sample"] * 3)
    by_name = {p.track_event.name: a for p, a in zip(slices, args)}
    assert by_name["forward_backward"]["tokens_in"].int_value == 4
    assert by_name["sample"]["tokens_in"].int_value == 3 and by_name["sample"]["tokens_out"].int_value == 4
    assert by_name["sample"]["service"].string_value.startswith("sampler 127.0.0.1:")
    assert {tracks[p.track_event.track_uuid].name.split(" #")[0] for p in slices} == {
        "trainer", by_name["sample"]["service"].string_value}
    ends = [p for p in events if p.track_event.type == pf.TrackEvent.TYPE_SLICE_END]
    queued = [p for p in events if p.track_event.name == "queued"]
    assert len(ends) == len(slices) + len(queued)          # every slice is closed
    for p in slices:
        assert tracks[p.track_event.track_uuid].parent_uuid in tracks      # under the session's track
    root = next(t for t in tracks.values() if t.name == f"tinkerd session {session}")
    assert "p50=" in root.description and "1 rate-limit refusal(s)" in root.description

    refusals = [p for p in events if p.track_event.name == "rate_limited"]
    assert len(refusals) == 1 and refusals[0].track_event.type == pf.TrackEvent.TYPE_INSTANT
    assert "sample requests are queued" in refusals[0].track_event.debug_annotations[0].string_value
    summary = {p.track_event.name: {a.name: a for a in p.track_event.debug_annotations}
               for p in events if p.track_event.name.startswith("latency ")}
    assert summary["latency sample"]["count"].int_value == 3
    assert summary["latency sample"]["p50_ms"].double_value <= summary["latency sample"]["p99_ms"].double_value
    counter = [p.track_event.counter_value for p in events if p.track_event.type == pf.TrackEvent.TYPE_COUNTER]
    assert counter and max(counter) >= 1 and counter[-1] == 0

    # The console's panels add up the same spans.
    panels = api.get(f"console/sessions/{session}/metrics").json()
    assert panels["requests"] == len(slices) and panels["rate_limited"] == 1
    assert panels["latency"]["sample"]["count"] == 3
    assert [p[0] for p in panels["step_times"][0]["points"]] == [1, 2]
    assert panels["in_flight_samples"]["now"] == 0
    assert sum(v for _, v in panels["tokens_per_s"]["training"]) * panels["bucket_s"] == pytest.approx(8)
    assert sum(v for _, v in panels["tokens_per_s"]["generation"]) * panels["bucket_s"] == pytest.approx(12)
    assert sum(v for _, v in panels["tokens_per_s"]["prefill"]) * panels["bucket_s"] == pytest.approx(9)
    assert 0 < panels["training_utilization"]["mean"] <= 1


def api_request_id_of_create(g, model_id: str) -> str:
    """create_model's future id (the fixture's Api.model keeps only the model id)."""
    rows = g.gw.db.select(select(TraceSpanRow.request_id).where(TraceSpanRow.kind == "create_model",
                                                                TraceSpanRow.model_id == model_id))
    return rows[0]


def test_the_trace_and_its_link_are_the_owners_only(make_gateway):
    g = make_gateway()
    api, mallory = g.api, g.api.as_user("mallory")
    session = api.session()
    assert_user_error(mallory.get(f"sessions/{session}/trace_export"), 404, "unknown session_id")
    assert_user_error(mallory.get(f"console/sessions/{session}/metrics"), 404, "unknown session")
    url = api.get(f"sessions/{session}/trace_export").json()["url"]
    assert _download(api, url).status_code == 200           # an empty session: a trace with its track only
    for tampered in (url.replace("signature=", "signature=x"), url.replace(session, api.session()),
                     url.replace("expires=", "expires=1")):
        assert_user_error(_download(api, tampered), 404, "unknown or has expired")


def test_each_session_keeps_at_most_its_span_budget(make_gateway):
    g = make_gateway(trace_spans_per_session=5)
    api = g.api
    busy, quiet = api.session(), api.session()
    model, quiet_model = api.model(busy), api.model(quiet)
    kept = []
    for seq in range(1, 9, 2):
        kept += _train(api, model, seq)          # 1 create + 8 training requests in `busy`
    g.gw.traces.flush()
    rows = g.gw.traces.of_session(busy)
    assert len(rows) == 5
    assert [r.request_id for r in rows] == kept[-5:]       # the newest are kept
    assert [r.model_id for r in g.gw.traces.of_session(quiet)] == [quiet_model]    # untouched by the other's cap
    trace = _read_trace(_download(api, api.get(f"sessions/{busy}/trace_export").json()["url"]).content)
    assert sum(1 for p in trace.packet if list(p.track_event.categories) == ["request"]) == 5


def test_a_span_budget_below_one_is_refused_at_start():
    from gateway.traces.spans import Traces
    with pytest.raises(ValueError, match="--trace-spans-per-session must be at least 1"):
        Traces(db=None, per_session=0)
