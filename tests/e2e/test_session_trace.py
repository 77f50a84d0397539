"""RestClient.export_session_trace end to end on the shared `tinkerd up`: a session trains and
samples through the SDK, the export gives a signed URL, a plain GET of it (no key, as the SDK
and `tinker session export-trace` fetch it) is a Perfetto trace that the official schema
(perfetto's perfetto_trace_pb2) reads, with one request slice per request of the session, each
on the service that ran it."""

from __future__ import annotations

import collections
import urllib.request

import pytest
import tinker
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pf
from tinker import types

from conftest import sft_data
from launcher import keys

pytestmark = pytest.mark.e2e


def test_export_session_trace_is_a_perfetto_trace_with_a_slice_per_request(stack, tiny_model_dir):
    key = keys.new_key(keys.open_database(stack.state_dir, None), "trace-erin")
    service = tinker.ServiceClient(base_url=stack.url, api_key=key)
    tc = service.create_lora_training_client(base_model=tiny_model_dir, rank=4, seed=0)
    data = sft_data(tc.get_tokenizer(), ["a trace of every request", "one slice each"])
    for _ in range(2):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    sampler = tc.save_weights_and_get_sampling_client("traced")
    prompt = types.ModelInput.from_ints(tc.get_tokenizer().encode("a trace"))
    futures = [sampler.sample(prompt, 2, types.SamplingParams(max_tokens=4, temperature=1.0)) for _ in range(3)]
    sampled = sum(len(s.tokens) for f in futures for s in f.result().sequences)
    session_id = tc.model_id.rpartition(":train:")[0]

    url = service.create_rest_client().export_session_trace(session_id).result()
    assert url.startswith(stack.url) and "signature=" in url
    with urllib.request.urlopen(url, timeout=30) as got:       # no credentials, like the SDK's CLI
        trace = pf.Trace.FromString(got.read())

    tracks = {p.track_descriptor.uuid: p.track_descriptor.name for p in trace.packet if p.HasField("track_descriptor")}
    slices = [p.track_event for p in trace.packet if p.HasField("track_event")
              and p.track_event.type == pf.TrackEvent.TYPE_SLICE_BEGIN and list(p.track_event.categories) == ["request"]]
    args = [{a.name: a for a in e.debug_annotations} for e in slices]
    assert collections.Counter(e.name for e in slices) == {
        "create_model": 1, "forward_backward": 2, "optim_step": 2, "save_weights_for_sampler": 1, "sample": 3}
    assert len({a["request_id"].string_value for a in args}) == len(slices)       # one slice per request
    assert all(a["status"].string_value == "complete" for a in args)
    services = {e.name: tracks[e.track_uuid].split(" #")[0] for e in slices}     # lane 2, 3...: " #n"
    assert services["optim_step"] == "trainer" and services["sample"].startswith("sampler ")
    assert sum(a["tokens_out"].int_value for e, a in zip(slices, args) if e.name == "sample") == sampled
    assert f"tinkerd session {session_id}" in tracks.values()
