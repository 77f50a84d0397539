"""retrieve_futures and cancel_future on the real app over fake backends, with a sampler that
holds each sample until the test lets it go: the completion queue's cursor and acknowledgements,
its long-poll, ownership (another user's session or id is as unknown as a missing one), bounds,
and cancellation (the cancelled future answers a user error; its place in the limits is held
until the sampler's work has ended)."""

from __future__ import annotations

import concurrent.futures
import threading
import time
import types

import grpc
import pytest
from fastapi.testclient import TestClient
from gateway_fakes import Api, FakeSampler, FakeTrainer, assert_user_error, fake_services
from sqlalchemy import func, select

from gateway.app import create_app
from gateway.protocol import MAX_RETRIEVED_IDS
from gateway.futures import completions as completions_module
from gateway.routes import futures as futures_routes
from gateway.storage.db import CompletionRow
from tinkerd.v1 import sampler_pb2

FAIL_TOKEN = 99        # a prompt starting with it fails in the sampler (a user error)


class HeldSampler(FakeSampler):
    """FakeSampler whose replies wait for `release` (set by default: no wait)."""

    def __init__(self):
        super().__init__()
        self.release = threading.Event()
        self.release.set()
        self.started = threading.Semaphore(0)
        self.cancelled = threading.Event()        # a held call the gateway cancelled

    def Sample(self, request, context):
        self.started.release()
        deadline = time.monotonic() + 30
        while not self.release.wait(0.02) and time.monotonic() < deadline:
            if not context.is_active():
                self.cancelled.set()
                return sampler_pb2.SampleResponse()
        if request.prompt_tokens[0] == FAIL_TOKEN:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "this prompt is refused")
        return super().Sample(request, context)


@pytest.fixture
def gw(tmp_path):
    trainer, sampler = FakeTrainer(str(tmp_path / "state")), HeldSampler()
    with fake_services(tmp_path, trainer, sampler) as settings:
        try:
            with TestClient(create_app(settings)) as client:
                api = Api(client, "").as_user("tester")
                yield types.SimpleNamespace(api=api, sampler=sampler, futures=client.app.state.gateway.futures,
                                            stability=client.app.state.gateway.stability,
                                            settings=client.app.state.gateway.settings)
        finally:
            sampler.release.set()


def _sampling_session(api) -> str:
    body = {"session_id": api.session(), "sampling_session_seq_id": 0, "base_model": "tiny/base"}
    return api.post("create_sampling_session", body).json()["sampling_session_id"]


def _sample(api, sid: str, seq_id: int, first_token: int = 3) -> str:
    body = {"sampling_session_id": sid, "seq_id": seq_id, "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [first_token, 4]}]},
            "sampling_params": {"max_tokens": 2}}
    r = api.post("asample", body)
    assert r.status_code == 200, r.text
    return r.json()["request_id"]


def _poll(api, sid: str, prev_cursor: int = 0, timeout: float | None = 5.0, clone: int = 0, **extra):
    body = {"target": {"type": "sampling_session", "sampling_session_id": sid, "cloned_sampler_id": clone},
            "prev_cursor": prev_cursor, "timeout": timeout, **extra}
    r = api.post("retrieve_futures", body)
    assert r.status_code == 200, r.text
    return r.json()


def _collect(api, sid: str, want: int, clone: int = 0) -> tuple[dict[str, dict], int]:
    """Polls as the SDK does (prev_cursor = the last answer's cursor) until `want` completions."""
    seen, cursor = {}, 0
    deadline = time.monotonic() + 10
    while len(seen) < want and time.monotonic() < deadline:
        out = _poll(api, sid, cursor, clone=clone)
        seen.update({c["request_id"]: c for c in out["completions"]})
        cursor = out["cursor"]
    return seen, cursor


def _collect_from(api, sid: str, cursor: int, want: set[str], clone: int = 0) -> tuple[dict[str, dict], int]:
    seen = {}
    deadline = time.monotonic() + 10
    while not want <= seen.keys() and time.monotonic() < deadline:
        out = _poll(api, sid, cursor, clone=clone, timeout=1.0)
        seen.update({c["request_id"]: c for c in out["completions"]})
    return seen, cursor


def test_the_sdk_is_told_to_use_both(gw):
    """Cancelling always; the session's poll only with --sample-session-poll (each sample's own
    long-poll costs less): retrieve_futures is served either way (the tests here)."""
    config = gw.api.post("client/config", {"sdk_version": "0.38.0"}).json()
    assert config["sample_use_retrieve_futures"] is False
    gw.settings.sample_session_poll = True
    assert gw.api.post("client/config", {"sdk_version": "0.38.0"}).json()["sample_use_retrieve_futures"] is True
    dynamic = gw.api.post("client/dynamic_config", {"sdk_version": "0.38.0"}).json()
    assert dynamic["sample_cancel_enabled"] is True and dynamic["sample_cancel_max_batch_size"] >= 1


def test_finished_samples_are_reported_once_acknowledged_then_fetched(gw):
    api = gw.api
    sid = _sampling_session(api)
    ids = [_sample(api, sid, seq) for seq in range(3)]
    seen, cursor = _collect(api, sid, 3)
    assert set(seen) == set(ids)
    payloads = {rid: api.result({"request_id": rid}) for rid in ids}
    for rid, c in seen.items():
        assert c["state"] == "finished"
        assert c["response_payload_uncompressed_size"] == len(payloads[rid].content)
        assert payloads[rid].headers["content-type"] == "application/x-protobuf"
    # Acknowledged (prev_cursor past them) and fetched: an ack-only poll answers at once, empty,
    # with the cursor unchanged (a larger one would make the SDK acknowledge again, for nothing).
    t0 = time.monotonic()
    assert _poll(api, sid, cursor, timeout=0) == {"completions": [], "cursor": cursor}
    assert time.monotonic() - t0 < 2


def test_a_lost_answer_is_sent_again_until_acknowledged(gw):
    api = gw.api
    sid = _sampling_session(api)
    rid = _sample(api, sid, 0)
    first, cursor = _collect(api, sid, 1)
    again = _poll(api, sid, 0, timeout=0)        # the client never saw the first answer
    assert [c["request_id"] for c in again["completions"]] == [rid] and again["cursor"] == cursor
    assert _poll(api, sid, cursor, timeout=0)["completions"] == []


def test_retrieved_ids_leave_the_queue(gw):
    api = gw.api
    sid = _sampling_session(api)
    ids = [_sample(api, sid, seq) for seq in range(2)]
    _collect(api, sid, 2)
    out = _poll(api, sid, 0, timeout=0, retrieved_request_ids=[ids[0]])
    assert [c["request_id"] for c in out["completions"]] == [ids[1]]


def test_the_payload_fetch_takes_it_off_the_queue(gw):
    """What keeps the queues empty for clients that never poll (SDK < 0.28)."""
    api = gw.api
    sid = _sampling_session(api)
    rid = _sample(api, sid, 0)
    assert api.result({"request_id": rid}).status_code == 200
    assert _poll(api, sid, 0, timeout=0)["completions"] == []
    assert gw.futures.completions.queued() == 0


def _completion_rows(gw) -> int:
    """The completions table's rows, read as they are (Completions.queued collects first)."""
    with gw.futures.db.engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(CompletionRow.__table__)).scalar()


def test_fetched_payloads_rows_go_together_without_a_poll(gw, monkeypatch):
    """A client that never polls: a fetch deletes nothing itself (no transaction of its own); the
    watcher deletes the rows of the payloads fetched meanwhile in one, every GARBAGE_S."""
    api = gw.api
    sid = _sampling_session(api)
    monkeypatch.setattr(completions_module, "GARBAGE_S", 3600.0)
    ids = [_sample(api, sid, seq) for seq in range(3)]
    for rid in ids:
        assert api.result({"request_id": rid}).status_code == 200
    assert _completion_rows(gw) == 3
    monkeypatch.setattr(completions_module, "GARBAGE_S", 0.1)
    deadline = time.monotonic() + 10
    while _completion_rows(gw) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _completion_rows(gw) == 0


def test_fetched_rows_whose_delete_failed_go_with_the_next_one(gw, monkeypatch):
    api, completions = gw.api, gw.futures.completions
    monkeypatch.setattr(completions_module, "GARBAGE_S", 3600.0)      # no watcher's collection meanwhile
    sid = _sampling_session(api)
    for rid in [_sample(api, sid, seq) for seq in range(2)]:
        assert api.result({"request_id": rid}).status_code == 200
    delete = completions._delete_fetched
    tries = []

    def failing_once(fetched):
        tries.append(1)
        if len(tries) == 1:
            raise RuntimeError("the database went away")
        delete(fetched)
    monkeypatch.setattr(completions, "_delete_fetched", failing_once)
    with pytest.raises(RuntimeError):
        completions.collect_garbage()
    assert _completion_rows(gw) == 2
    completions.collect_garbage()
    assert _completion_rows(gw) == 0 and len(tries) == 2


def test_a_reported_sample_leaves_the_queue_once_with_the_next_poll(gw):
    """SDK 0.38: a poll reports a sample, the SDK fetches its payload, and its next poll carries
    the cursor and the fetched id. The row goes in that poll's own transaction; the fetch leaves it
    (one delete a sample, not one at the fetch and another at the acknowledgement)."""
    api = gw.api
    sid = _sampling_session(api)
    rid = _sample(api, sid, 0)
    seen, cursor = _collect(api, sid, 1)
    assert set(seen) == {rid}
    assert api.result({"request_id": rid}).status_code == 200
    assert gw.futures.completions.queued() == 1            # reported here: the next poll acknowledges it
    assert _poll(api, sid, cursor, timeout=0, retrieved_request_ids=[rid]) == {"completions": [], "cursor": cursor}
    assert gw.futures.completions.queued() == 0


def test_a_session_known_empty_is_acknowledged_without_a_look(gw, monkeypatch):
    """SDK 0.38 polls three times for a lone sample; the last two only acknowledge. Once a look
    here reported all there was up to the client's cursor and no sample of its session finished
    since, an acknowledgement-only poll answers from memory (no look at the database), a long
    poll waits for a finish before it looks, and the acknowledged rows go with the watcher's next
    collection. A poll from an older cursor (an answer the client never got) still looks."""
    api = gw.api
    completions = gw.futures.completions
    # The watcher's collection held off: under load it could apply the deferred id between two
    # polls, before the look that is to take it along.
    monkeypatch.setattr(completions_module, "GARBAGE_S", 3600.0)
    sid = _sampling_session(api)
    rid = _sample(api, sid, 0)
    _, cursor = _collect(api, sid, 1)
    assert api.result({"request_id": rid}).status_code == 200
    looks = []
    take = completions._take
    monkeypatch.setattr(completions, "_take", lambda *a, **k: looks.append(a) or take(*a, **k))
    assert _poll(api, sid, cursor, timeout=0) == {"completions": [], "cursor": cursor}
    assert _poll(api, sid, cursor, timeout=0, retrieved_request_ids=[rid]) == {"completions": [], "cursor": cursor}
    assert looks == []
    many = [f"{i:032x}" for i in range(completions_module.DEFER_IDS + 1)]     # more than a few: applied at once
    assert _poll(api, sid, cursor, timeout=0, retrieved_request_ids=many) == {"completions": [], "cursor": cursor}
    assert len(looks) == 1 and looks.pop()[3] == [rid, *many]      # with the one deferred before
    # A long poll waits without a look until its session's next sample finishes here.
    gw.sampler.release.clear()
    second = _sample(api, sid, 1)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(_poll, api, sid, cursor, 20.0)
        time.sleep(0.3)
        assert not waiting.done() and looks == []
        gw.sampler.release.set()
        out = waiting.result(timeout=10)
    assert [c["request_id"] for c in out["completions"]] == [second] and len(looks) == 1
    again = _poll(api, sid, cursor, timeout=0)          # that answer lost: from the older cursor
    assert [c["request_id"] for c in again["completions"]] == [second] and len(looks) == 2
    assert completions.queued() == 1          # the second sample's, reported, not acknowledged yet


def test_a_samples_stability_records_are_written_off_the_event_loop(gw, monkeypatch):
    """record_stability_info: the sampled sequences are written on the database's threads (the
    event loop only awaits; a database that stalls must not stall every request with it)."""
    api = gw.api
    stability = gw.stability
    threads = []
    record_all = stability.record_all
    monkeypatch.setattr(stability, "record_all", lambda *a: threads.append(threading.current_thread().name)
                        or record_all(*a))
    sid = _sampling_session(api)
    body = {"sampling_session_id": sid, "seq_id": 0, "num_samples": 1, "record_stability_info": True,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [3, 4]}]}, "sampling_params": {"max_tokens": 2}}
    rid = api.post("asample", body).json()["request_id"]
    assert set(_collect(api, sid, 1)[0]) == {rid}
    assert len(threads) == 1 and threads[0].startswith("db"), threads
    assert len(stability) == 1


def test_clones_have_their_own_queue(gw):
    api = gw.api
    sid = _sampling_session(api)
    original, clone = _sample(api, sid, 0), _sample(api, sid, 7 * 1_000_000_000 + 1)
    assert set(_collect(api, sid, 1, clone=7)[0]) == {clone}
    assert set(_collect(api, sid, 1, clone=0)[0]) == {original}


def test_the_poll_waits_for_the_first_completion(gw):
    api = gw.api
    sid = _sampling_session(api)
    gw.sampler.release.clear()
    rid = _sample(api, sid, 0)
    t0 = time.monotonic()
    assert _poll(api, sid, 0, timeout=0.3) == {"completions": [], "cursor": 0}
    assert 0.25 < time.monotonic() - t0 < 5
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(_poll, api, sid, 0, 20.0)
        time.sleep(0.3)
        assert not waiting.done()
        gw.sampler.release.set()
        out = waiting.result(timeout=10)
    assert [c["request_id"] for c in out["completions"]] == [rid]


def test_a_failed_sample_is_reported_failed(gw):
    api = gw.api
    sid = _sampling_session(api)
    rid = _sample(api, sid, 0, first_token=FAIL_TOKEN)
    seen, _ = _collect(api, sid, 1)
    assert seen[rid] == {"state": "failed", "request_id": rid, "response_payload_uncompressed_size": None}
    assert_user_error(api.result({"request_id": rid}), 200, "this prompt is refused")


def test_answers_are_paged(gw, monkeypatch):
    monkeypatch.setattr(futures_routes, "MAX_COMPLETIONS", 2)
    api = gw.api
    sid = _sampling_session(api)
    ids = [_sample(api, sid, seq) for seq in range(3)]
    deadline = time.monotonic() + 10
    while gw.futures.pending("sample") and time.monotonic() < deadline:
        time.sleep(0.05)
    first = _poll(api, sid, 0, timeout=0)
    second = _poll(api, sid, first["cursor"], timeout=0)
    assert [len(first["completions"]), len(second["completions"])] == [2, 1]
    assert {c["request_id"] for c in first["completions"] + second["completions"]} == set(ids)


def test_another_users_session_and_ids_are_unknown(gw):
    api, other = gw.api, gw.api.as_user("mallory")
    sid = _sampling_session(api)
    rid = _sample(api, sid, 0)
    _collect(api, sid, 1)
    body = {"target": {"sampling_session_id": sid}, "timeout": 0}
    theirs = assert_user_error(other.post("retrieve_futures", body), 404, "unknown sampling_session_id")
    missing = assert_user_error(other.post("retrieve_futures", {"target": {"sampling_session_id": sid + "9"},
                                                                "timeout": 0}), 404, "unknown sampling_session_id")
    assert theirs["error"].replace(sid, "") == missing["error"].replace(sid + "9", "")
    # Acknowledging someone else's id from one's own session touches nothing of theirs, and reads
    # the same as acknowledging an id that does not exist.
    own = _sampling_session(other)
    answers = [_poll(other, own, 0, timeout=0, retrieved_request_ids=[ids]) for ids in (rid, "f" * 32)]
    assert answers[0] == answers[1] == {"completions": [], "cursor": 0}
    assert [c["request_id"] for c in _poll(api, sid, 0, timeout=0)["completions"]] == [rid]
    assert_user_error(other.post("cancel_future", {"request_id": rid}), 404, "unknown request_id")


@pytest.mark.parametrize("body, words", [
    ({}, ["target"]),
    ({"target": {"type": "training_run", "sampling_session_id": "x"}}, ["target.type"]),
    ({"target": {"sampling_session_id": "x", "cloned_sampler_id": -1}}, ["cloned_sampler_id"]),
    ({"target": {"sampling_session_id": "x"}, "prev_cursor": -5}, ["prev_cursor"]),
    ({"target": {"sampling_session_id": "x"}, "timeout": -1}, ["timeout"]),
    ({"target": {"sampling_session_id": "x"}, "retrieved_request_ids": "abc"}, ["retrieved_request_ids"]),
    ({"target": {"sampling_session_id": "x"}, "retrieved_request_ids": ["a"] * (MAX_RETRIEVED_IDS + 1)},
     ["retrieved_request_ids", f"at most {MAX_RETRIEVED_IDS}"]),
])
def test_bad_retrieve_futures_bodies(gw, body, words):
    assert_user_error(gw.api.post("retrieve_futures", body), 400, *words)


def test_retrieve_futures_not_json(gw):
    r = gw.api.client.post("/api/v1/retrieve_futures", content=b"{x",
                           headers={"X-API-Key": gw.api.api_key, "content-type": "application/json"})
    assert_user_error(r, 400, "not valid JSON")


def test_cancel_a_pending_sample(gw):
    api, futures = gw.api, gw.futures
    sid = _sampling_session(api)
    gw.sampler.release.clear()
    rid = _sample(api, sid, 0)
    assert gw.sampler.started.acquire(timeout=10)         # at the sampler
    r = api.post("cancel_future", {"request_id": rid})
    assert r.status_code == 200 and r.json() == {"request_id": rid, "cancelled": True, "status": "cancelled"}
    assert _collect(api, sid, 1)[0][rid]["state"] == "failed"
    assert_user_error(api.result({"request_id": rid}), 200, "cancelled")
    # The gateway cancelled the sampler call (the real sampler aborts the generation then), so the
    # sample's place in the limits is free without the sampler finishing it.
    assert gw.sampler.cancelled.wait(10)
    deadline = time.monotonic() + 10
    while futures.pending("sample") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert futures.pending("sample") == 0
    again = api.post("cancel_future", {"request_id": rid}).json()
    assert again == {"request_id": rid, "cancelled": False, "status": "failed"}     # its job has ended
    assert_user_error(api.result({"request_id": rid}), 200, "cancelled")


def test_cancel_a_finished_future_changes_nothing(gw):
    api = gw.api
    sid = _sampling_session(api)
    rid = _sample(api, sid, 0)
    payload = api.result({"request_id": rid})
    r = api.post("cancel_future", {"request_id": rid})
    assert r.status_code == 200 and r.json() == {"request_id": rid, "cancelled": False, "status": "complete"}
    assert api.result({"request_id": rid}).content == payload.content


def test_cancel_refusals(gw):
    api = gw.api
    assert_user_error(api.post("cancel_future", {"request_id": "nope"}), 404, "unknown request_id")
    assert_user_error(api.post("cancel_future", {"request_id": 7}), 400, "request_id")
    # A training request waiting for its turn (seq_id 5 while 1..4 never came) is not cancellable.
    model_id = api.model(api.session())
    pending = api.post("optim_step", {"model_id": model_id, "seq_id": 5,
                                      "adam_params": {"learning_rate": 1e-4}}).json()["request_id"]
    assert_user_error(api.post("cancel_future", {"request_id": pending}), 400, "only samples")


def test_stats_are_for_admins(gw):
    r = gw.api.client.get("/internal/futures_stats", headers={"X-API-Key": gw.api.api_key})
    assert_user_error(r, 404)


def test_completions_finishing_together_come_in_one_answer(gw, monkeypatch):
    monkeypatch.setattr(futures_routes, "GATHER_S", 1.0)
    api = gw.api
    sid = _sampling_session(api)
    gw.sampler.release.clear()
    ids = [_sample(api, sid, seq) for seq in range(2)]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(_poll, api, sid, 0, 20.0)
        time.sleep(0.3)
        gw.sampler.release.set()
        out = waiting.result(timeout=10)
    assert {c["request_id"] for c in out["completions"]} == set(ids)


def test_a_lone_samples_answer_does_not_wait_to_gather(gw, monkeypatch):
    """The poll gathers only while more of the session's samples run here: a lone sample's
    completion is answered as soon as it finishes (a whole gather was a fifth of a lone 1-token
    sample's time through the SDK)."""
    monkeypatch.setattr(futures_routes, "GATHER_S", 3.0)
    api = gw.api
    sid = _sampling_session(api)
    gw.sampler.release.clear()
    rid = _sample(api, sid, 0)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(_poll, api, sid, 0, 20.0)
        time.sleep(0.3)
        released = time.monotonic()
        gw.sampler.release.set()
        out = waiting.result(timeout=10)
    assert time.monotonic() - released < 1.5
    assert [c["request_id"] for c in out["completions"]] == [rid]


def test_a_completion_from_elsewhere_is_gathered_for_and_a_lone_one_from_here_is_not(tmp_path):
    """Whether a poll woken by a completion waits GATHER_S for more: yes when the watcher found it
    (what else runs elsewhere is not known here), when another gateway's message says more of the
    target's samples run there, or while another of them runs here; no for the last one finished
    here, nor for one whose gateway's message says it was its last."""
    import asyncio
    import collections

    from gateway.futures.peers import Peers
    from gateway.storage.db import Database, now

    db = Database(f"sqlite:///{tmp_path / 'db.sqlite'}")
    running: collections.Counter = collections.Counter()
    queue = completions_module.Completions(db, Peers(db.engine, "here"), running=running.__getitem__)
    target = ("session:sample:0", 0)

    def write(request_id: str) -> None:
        with db.engine.begin() as conn:
            completions_module.insert(conn, queue.row(target, False, 10), request_id, now())

    async def answer_after(cursor: int, request_id: str, told_by: str | None,
                           more_elsewhere: bool = False) -> tuple[float, int]:
        poll = asyncio.create_task(queue.poll(target, cursor, 20.0, 100, gather_s=1.0))
        await asyncio.sleep(0.2)
        await asyncio.to_thread(write, request_id)
        t0 = time.monotonic()
        queue.arrived(target, told_by, more_elsewhere)
        found, cursor = await poll
        assert [c.request_id for c in found] == [request_id]
        return time.monotonic() - t0, cursor

    async def main():
        waited, cursor = await answer_after(0, "a" * 32, None)              # elsewhere
        assert waited >= 1.0
        running[target] = 1                                                  # another runs here
        waited, cursor = await answer_after(cursor, "b" * 32, "b" * 32)
        assert waited >= 1.0
        running[target] = 0                                                  # the last one here
        waited, cursor = await answer_after(cursor, "c" * 32, "c" * 32)
        assert waited < 0.5
        waited, cursor = await answer_after(cursor, "d" * 32, "d" * 32, more_elsewhere=True)    # more there
        assert waited >= 1.0
        waited, cursor = await answer_after(cursor, "e" * 32, "e" * 32, more_elsewhere=False)   # its last there
        assert waited < 0.5
    try:
        asyncio.run(main())
    finally:
        db.engine.dispose()


def test_another_gateways_message_of_a_sample_reported_here_is_news_only_when_reported_again(tmp_path):
    """A sample a poll here reported already is no news when its gateway announces its finish
    (the look here saw it), but is when a resend made its gateway write its completion again
    (AGAIN): the target is no longer known empty here, so the next poll looks."""
    from gateway.futures.peers import AGAIN
    from gateway.futures.store import Futures
    from gateway.storage.db import Database

    futures = Futures(Database(f"sqlite:///{tmp_path / 'db.sqlite'}"))
    queue, target = futures.completions, ("session:sample:0", 0)
    queue._reported["r1"] = None            # a look here reported it
    queue._clean[target] = 5                # ... and left nothing after cursor 5
    futures.heard("r1", target, 0)
    assert queue._clean.get(target) == 5
    futures.heard("r1", target, AGAIN)
    assert target not in queue._clean
    futures.db.engine.dispose()


def test_a_poller_from_before_a_restart_hears_of_its_redriven_samples(tmp_path):
    """Samples the earlier gateway process never finished are re-driven once its lease lapses;
    a client still polling with that process's cursor gets them reported, finished."""
    trainer, sampler = FakeTrainer(str(tmp_path / "state")), HeldSampler()
    with fake_services(tmp_path, trainer, sampler, future_lease_s=0.3) as settings:
        try:
            with TestClient(create_app(settings)) as client:
                api = Api(client, "").as_user("tester")
                sid = _sampling_session(api)
                done = _sample(api, sid, 0)
                _, cursor = _collect(api, sid, 1)
                assert api.result({"request_id": done}).status_code == 200
                sampler.release.clear()
                orphan, other_clone = _sample(api, sid, 1), _sample(api, sid, 3 * 1_000_000_000)
                assert sampler.started.acquire(timeout=10)
            sampler.release.set()
            with TestClient(create_app(settings)) as client:
                api = Api(client, api.api_key)
                seen, _ = _collect_from(api, sid, cursor, {orphan})
                assert seen[orphan]["state"] == "finished"
                assert api.result({"request_id": orphan}).status_code == 200
                seen, _ = _collect_from(api, sid, cursor, {other_clone}, clone=3)
                assert seen[other_clone]["state"] == "finished"
        finally:
            sampler.release.set()


def test_a_large_result_is_announced_by_its_size_when_the_sdk_allows_it(gw, monkeypatch):
    """SDK 0.38 asks with allow_metadata_only: a result over METADATA_ONLY_BYTES is answered with its
    size first (the SDK reserves that much, then asks again without the flag for the payload)."""
    monkeypatch.setattr(futures_routes, "METADATA_ONLY_BYTES", 8)
    api = gw.api
    rid = _sample(api, _sampling_session(api), 0)
    payload = api.result({"request_id": rid})
    assert payload.status_code == 200 and len(payload.content) > 8
    first = api.post("retrieve_future", {"request_id": rid, "allow_metadata_only": True})
    assert first.json() == {"status": "complete_metadata", "response_payload_size": len(payload.content)}
    again = api.post("retrieve_future", {"request_id": rid, "allow_metadata_only": False})
    assert again.content == payload.content


def test_a_database_that_stops_answering_stalls_no_other_request(gw, tmp_path):
    """Samples sent while another process holds the database's write lock wait on the database's
    threads, not on the event loop: healthz and a finished future's retrieve answer at once, and
    the samples finish once the lock is let go."""
    import sqlite3

    api = gw.api
    sid = _sampling_session(api)
    done = api.result({"request_id": _sample(api, sid, 0)})
    assert done.status_code == 200
    writer = sqlite3.connect(tmp_path / "state" / "tinkerd.db", isolation_level=None)
    writer.execute("BEGIN EXCLUSIVE")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        samples = [pool.submit(_sample, api, sid, seq) for seq in (1, 2, 3)]
        time.sleep(0.5)          # the samples' rows are being written: blocked on the lock
        assert not any(s.done() for s in samples)
        for _ in range(3):
            t0 = time.monotonic()
            assert api.client.get("/api/v1/healthz").status_code in (200, 503)
            assert time.monotonic() - t0 < 0.25
        writer.execute("ROLLBACK")
        ids = [s.result(timeout=30) for s in samples]
    assert all(api.result({"request_id": i}).status_code == 200 for i in ids)
