"""A session's requests (create, heartbeats, close), its training and sampling loop's, and the
gateway's housekeeping run no SQL on the event loop's thread: the
database is read and written on its own threads (gateway/storage/db.py Database.run), so a
database that stops answering stalls those threads, never the loop (healthz, every tenant's
polls). Every statement the gateway executes while the loop's requests are made is checked for
the thread it runs on (fake backends over real gRPC), with the row cache warm, as in a busy loop,
and cold, as after a pause longer than its TTL (every row read again)."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import event

from gateway import housekeeping
from gateway.storage import db

from gateway_fakes import gateway  # noqa: F401 - the fixture
from test_direct_routes import _fb
from test_stateless_gateways import _forward_backward, _recorded_sample

# Threads the gateway hands database work to: its database pool, the credential lookups', and
# asyncio's default executor (asyncio.to_thread).
DATABASE_THREADS = ("db_", "auth-lookup_", "asyncio_")


@pytest.mark.parametrize("cache", ["warm", "cold"])
def test_a_session_training_and_sampling_runs_no_sql_on_the_event_loop(gateway, monkeypatch, cache):
    if cache == "cold":
        monkeypatch.setattr(db, "CACHE_TTL_S", 0.0)
    api = gateway.api
    session_id = api.session()
    model_id = api.model(session_id)
    sequence_id = _recorded_sample(api, session_id)         # for stable_reinforce steps
    proto = {"content-type": "application/x-protobuf", "X-API-Key": api.api_key}

    def save(seq_id: int, **body) -> dict:
        r = api.post("save_weights_for_sampler", {"model_id": model_id, "seq_id": seq_id, **body})
        assert r.status_code == 200, r.text
        return api.result(r.json()).json()
    inflight = save(1, sampling_session_seq_id=20, kind="inflight")["sampling_session_id"]
    snapshot = save(2, sampling_session_seq_id=21)["sampling_session_id"]

    ran_on: list[tuple[str, str]] = []
    engine = api.client.app.state.gateway.db.engine

    def note(_conn, _cursor, statement, *_):
        ran_on.append((threading.current_thread().name, statement[:60]))
    event.listen(engine, "before_cursor_execute", note)
    try:
        for step in range(2):
            assert api.post("session_heartbeat", {"session_id": session_id}).status_code == 200
            seq = 3 + 5 * step
            fb = api.client.post("/api/v1/forward_backward", content=_fb(model_id, seq), headers=proto)
            assert api.result(fb.json()).status_code == 200
            stable = _forward_backward(api, model_id, seq + 1, sequence_id)
            assert api.result(stable.json()).status_code == 200, stable.text
            optim = api.post("optim_step", {"model_id": model_id, "seq_id": seq + 2,
                                            "adam_params": {"learning_rate": 1e-4}})
            assert api.result(optim.json()).status_code == 200
            save(seq + 3, sampling_session_seq_id=30 + step, kind="inflight")
            path = save(seq + 4, path=f"step-{step}")["path"]
            for ss_seq, over in ((40 + step, {"base_model": "tiny/base"}), (50 + step, {"model_path": path})):
                made = api.post("create_sampling_session", {"session_id": session_id,
                                                            "sampling_session_seq_id": ss_seq, **over})
                assert made.status_code == 200, made.text
            for sid in (inflight, snapshot):
                sample = api.post("asample", {"sampling_session_id": sid, "seq_id": step, "num_samples": 1,
                                              "prompt": {"chunks": [{"type": "encoded_text", "tokens": [3, 4]}]}})
                assert api.result(sample.json()).status_code == 200
                polled = api.post("retrieve_futures", {"target": {"sampling_session_id": sid, "cloned_sampler_id": 0},
                                                       "timeout": 0})
                assert polled.status_code == 200
        other = api.session()
        assert api.post(f"sessions/{other}/finish", {}).status_code == 200
        api.client.portal.call(housekeeping.one_pass, api.client.app.state.gateway)    # on the loop's thread
    finally:
        event.remove(engine, "before_cursor_execute", note)
    assert ran_on, "no statement was seen: the check would pass vacuously"
    on_loop = [(thread, verb) for thread, verb in ran_on if not thread.startswith(DATABASE_THREADS)]
    assert on_loop == [], f"SQL on the event loop's thread: {on_loop}"
