"""A session's request spans as a Perfetto trace (`.pftrace`: a `perfetto.protos.Trace`, the
TracePacket protobuf that ui.perfetto.dev and the trace processor open).

The messages are written with the documented schema (perfetto/protos/perfetto/trace/
perfetto_trace.proto) reduced to the fields used here, declared below with the same field
numbers in a descriptor pool of their own (so it never clashes with the full schema, e.g. the
`perfetto` package's, in one process). What the file holds:
- a track for the session, and under it one track per service lane ("trainer", "sampler
  <address>"; concurrent requests of one service get lanes #2, #3, ... so slices never overlap);
- one slice per request (category "request", named by its kind) from received to finished, with
  a child slice "queued" until it started, and its id, status, tokens and times as arguments;
- an instant event per rate-limit refusal on a "rate limits" track;
- a counter track of the samples in flight;
- a "latency" track with one instant event per request kind carrying count and p50/p90/p99/max,
  which the session track's description repeats.
"""

from __future__ import annotations

import functools
from typing import Sequence

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from gateway.traces import session_metrics

# TrackEvent.Type and TracePacket.SequenceFlags values of the Perfetto schema.
SLICE_BEGIN, SLICE_END, INSTANT, COUNTER = 1, 2, 3, 4
SEQ_INCREMENTAL_STATE_CLEARED = 1
_SEQUENCE_ID = 1

_F = descriptor_pb2.FieldDescriptorProto
# message -> [(field, number, type, label, message type)]: Perfetto's numbers, not ours to change.
_SCHEMA = {
    "Trace": [("packet", 1, _F.TYPE_MESSAGE, _F.LABEL_REPEATED, "TracePacket")],
    "TracePacket": [("timestamp", 8, _F.TYPE_UINT64, _F.LABEL_OPTIONAL, None),
                    ("trusted_packet_sequence_id", 10, _F.TYPE_UINT32, _F.LABEL_OPTIONAL, None),
                    ("track_event", 11, _F.TYPE_MESSAGE, _F.LABEL_OPTIONAL, "TrackEvent"),
                    ("sequence_flags", 13, _F.TYPE_UINT32, _F.LABEL_OPTIONAL, None),
                    ("track_descriptor", 60, _F.TYPE_MESSAGE, _F.LABEL_OPTIONAL, "TrackDescriptor")],
    "TrackDescriptor": [("uuid", 1, _F.TYPE_UINT64, _F.LABEL_OPTIONAL, None),
                        ("name", 2, _F.TYPE_STRING, _F.LABEL_OPTIONAL, None),
                        ("process", 3, _F.TYPE_MESSAGE, _F.LABEL_OPTIONAL, "ProcessDescriptor"),
                        ("parent_uuid", 5, _F.TYPE_UINT64, _F.LABEL_OPTIONAL, None),
                        ("counter", 8, _F.TYPE_MESSAGE, _F.LABEL_OPTIONAL, "CounterDescriptor"),
                        ("description", 14, _F.TYPE_STRING, _F.LABEL_OPTIONAL, None)],
    "ProcessDescriptor": [("pid", 1, _F.TYPE_INT32, _F.LABEL_OPTIONAL, None),
                          ("process_name", 6, _F.TYPE_STRING, _F.LABEL_OPTIONAL, None)],
    "CounterDescriptor": [("unit_name", 6, _F.TYPE_STRING, _F.LABEL_OPTIONAL, None)],
    "TrackEvent": [("debug_annotations", 4, _F.TYPE_MESSAGE, _F.LABEL_REPEATED, "DebugAnnotation"),
                   ("type", 9, _F.TYPE_INT32, _F.LABEL_OPTIONAL, None),        # an enum on the wire
                   ("track_uuid", 11, _F.TYPE_UINT64, _F.LABEL_OPTIONAL, None),
                   ("categories", 22, _F.TYPE_STRING, _F.LABEL_REPEATED, None),
                   ("name", 23, _F.TYPE_STRING, _F.LABEL_OPTIONAL, None),
                   ("counter_value", 30, _F.TYPE_INT64, _F.LABEL_OPTIONAL, None)],
    "DebugAnnotation": [("int_value", 4, _F.TYPE_INT64, _F.LABEL_OPTIONAL, None),
                        ("double_value", 5, _F.TYPE_DOUBLE, _F.LABEL_OPTIONAL, None),
                        ("string_value", 6, _F.TYPE_STRING, _F.LABEL_OPTIONAL, None),
                        ("name", 10, _F.TYPE_STRING, _F.LABEL_OPTIONAL, None)],
}
_PACKAGE = "tinkerd.pftrace"      # our own name: wire-compatible with perfetto.protos


@functools.cache
def _classes() -> dict[str, type]:
    file = descriptor_pb2.FileDescriptorProto(name="tinkerd/pftrace.proto", package=_PACKAGE, syntax="proto2")
    for name, fields in _SCHEMA.items():
        msg = file.message_type.add(name=name)
        for field, number, type_, label, type_name in fields:
            f = msg.field.add(name=field, number=number, type=type_, label=label)
            if type_name:
                f.type_name = f".{_PACKAGE}.{type_name}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_PACKAGE}.{name}"))
            for name in _SCHEMA}


class _Writer:
    def __init__(self):
        self.trace = _classes()["Trace"]()
        self._uuid = 0

    def _packet(self, timestamp_ns: int | None = None):
        p = self.trace.packet.add(trusted_packet_sequence_id=_SEQUENCE_ID)
        if len(self.trace.packet) == 1:
            p.sequence_flags = SEQ_INCREMENTAL_STATE_CLEARED
        if timestamp_ns is not None:
            p.timestamp = timestamp_ns
        return p

    def track(self, name: str, parent: int | None = None, *, counter_unit: str | None = None,
              pid: int | None = None, description: str = "") -> int:
        self._uuid += 1
        d = self._packet().track_descriptor
        d.uuid, d.name = self._uuid, name
        if parent is not None:
            d.parent_uuid = parent
        if pid is not None:
            d.process.pid, d.process.process_name = pid, name
        if counter_unit is not None:
            d.counter.unit_name = counter_unit
        if description:
            d.description = description
        return self._uuid

    def event(self, track: int, type_: int, at_us: int, name: str = "", categories: Sequence[str] = (),
              args: dict | None = None, counter: int | None = None) -> None:
        e = self._packet(at_us * 1000).track_event
        e.type, e.track_uuid = type_, track
        if name:
            e.name = name
        e.categories.extend(categories)
        if counter is not None:
            e.counter_value = counter
        for key, value in (args or {}).items():
            a = e.debug_annotations.add(name=key)
            if isinstance(value, bool) or isinstance(value, str):
                a.string_value = str(value)
            elif isinstance(value, int):
                a.int_value = value
            else:
                a.double_value = float(value)


def _lanes(spans: Sequence) -> list[int]:
    """A lane per span so that spans of one service on one lane never overlap (first fit)."""
    ends: dict[str, list[int]] = {}
    lanes = []
    for s in spans:
        service_ends = ends.setdefault(s.service, [])
        lane = next((i for i, end in enumerate(service_ends) if end < s.received_us), len(service_ends))
        if lane == len(service_ends):
            service_ends.append(0)
        service_ends[lane] = s.finished_us
        lanes.append(lane)
    return lanes


def _summary(latency: dict) -> str:
    return "; ".join(f"{kind}: n={v['count']} p50={v['p50_s'] * 1e3:.1f} ms p90={v['p90_s'] * 1e3:.1f} ms "
                     f"p99={v['p99_s'] * 1e3:.1f} ms max={v['max_s'] * 1e3:.1f} ms" for kind, v in latency.items())


def build(session_id: str, spans: Sequence) -> bytes:
    """The serialized Trace of the session's spans (TraceSpanRow-like: gateway/storage/db.py)."""
    w = _Writer()
    requests = sorted((s for s in spans if session_metrics.is_request(s)), key=lambda s: (s.received_us, s.span_id))
    refused = [s for s in spans if not session_metrics.is_request(s)]
    latency = session_metrics.latency(requests)
    root = w.track(f"tinkerd session {session_id}", pid=1,
                   description=f"{len(requests)} request(s), {len(refused)} rate-limit refusal(s). "
                               f"Latency, received to finished: {_summary(latency) or 'no requests'}")
    lane_tracks: dict[tuple[str, int], int] = {}
    in_flight: list[tuple[int, int]] = []
    for span, lane in zip(requests, _lanes(requests)):
        key = (span.service or "gateway", lane)
        if key not in lane_tracks:
            lane_tracks[key] = w.track(key[0] if lane == 0 else f"{key[0]} #{lane + 1}", root)
        track = lane_tracks[key]
        started = span.started_us if span.started_us is not None else span.finished_us
        args = {"request_id": span.request_id, "status": span.status, "service": span.service,
                "queued_ms": (started - span.received_us) / 1e3, "run_ms": (span.finished_us - started) / 1e3,
                "tokens_in": span.tokens_in, "tokens_out": span.tokens_out}
        if span.model_id:
            args["model_id"] = span.model_id
        w.event(track, SLICE_BEGIN, span.received_us, span.kind, ("request",), args)
        if span.received_us < started < span.finished_us:    # a child must end strictly inside its parent
            w.event(track, SLICE_BEGIN, span.received_us, "queued", ("phase",))
            w.event(track, SLICE_END, started)
        w.event(track, SLICE_END, span.finished_us)
        if span.kind == "sample":
            in_flight += [(span.received_us, 1), (span.finished_us, -1)]
    if in_flight:
        counter, level = w.track("samples in flight", root, counter_unit="requests"), 0
        for at, delta in sorted(in_flight):
            level += delta
            w.event(counter, COUNTER, at, counter=level)
    if refused:
        limits = w.track("rate limits", root)
        for s in refused:
            w.event(limits, INSTANT, s.finished_us, "rate_limited", ("rate_limit",), {"detail": s.detail})
    if latency:
        summary = w.track("latency", root, description=_summary(latency))
        end = max(s.finished_us for s in spans)
        for kind, v in latency.items():
            w.event(summary, INSTANT, end, f"latency {kind}", ("summary",), {
                "count": v["count"], "p50_ms": v["p50_s"] * 1e3, "p90_ms": v["p90_s"] * 1e3,
                "p99_ms": v["p99_s"] * 1e3, "max_ms": v["max_s"] * 1e3})
    return w.trace.SerializeToString()
