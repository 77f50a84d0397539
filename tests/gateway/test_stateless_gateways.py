"""Two gateways on one database (fake backends): a future accepted by one is answered by the
other, and a gateway that stops renewing its lease has its pending futures claimed and re-driven
by the other, from the request stored in the row. A session closed through one is closed on the
other, and a stable_reinforce step on one finds the sequences sampled through the other."""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient
from gateway_fakes import Api, FakeTrainer, assert_user_error, fake_services
from test_futures_routes import HeldSampler, _sample, _sampling_session

from gateway import tinker_wire_pb2 as tw
from gateway.app import create_app
from gateway.futures import completions as completions_module
from gateway.futures import waits as waits_module
from gateway.futures.peers import Peers
from gateway.storage import db as db_module
from gateway.storage.db import FutureRow
from tinkerd.tensors import to_numpy

PROTOBUF = {"content-type": "application/x-protobuf"}


class HeldTrainer(FakeTrainer):
    """Its OptimStep waits for `release` and reports that it started."""

    def __init__(self, state_dir):
        super().__init__(state_dir)
        self.release = threading.Event()
        self.release.set()
        self.started = threading.Semaphore(0)
        self.held = []

    def OptimStep(self, request, context):
        self.held.append(request)
        self.started.release()
        self.release.wait(30)
        return super().OptimStep(request, context)


@pytest.fixture
def two(tmp_path):
    trainer, sampler = HeldTrainer(str(tmp_path / "state")), HeldSampler()
    with fake_services(tmp_path, trainer, sampler, future_lease_s=0.3) as settings:
        try:
            yield trainer, sampler, settings
        finally:
            trainer.release.set()
            sampler.release.set()


def test_a_future_is_answered_and_cancelled_by_the_other_gateway(two):
    trainer, sampler, settings = two
    with TestClient(create_app(settings)) as a, TestClient(create_app(settings)) as b:
        api_a = Api(a, "").as_user("tester")
        api_b = Api(b, api_a.api_key)
        sid = _sampling_session(api_a)
        sampler.release.clear()
        held, cancelled = _sample(api_a, sid, 0), _sample(api_a, sid, 1)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(api_b.result, {"request_id": held})
            assert not waiting.done()
            out = api_b.post("cancel_future", {"request_id": cancelled}).json()
            assert out["cancelled"] and out["status"] == "cancelled"
            sampler.release.set()
            answer = waiting.result(timeout=10)
        assert answer.status_code == 200 and answer.content == api_a.result({"request_id": held}).content
        assert api_a.result({"request_id": cancelled}).json()["category"] == "user"
        assert api_b.post("retrieve_future", {"request_id": "nope"}).status_code == 404


def test_a_stopped_gateways_futures_are_claimed_after_the_lease_and_re_driven(two):
    trainer, sampler, settings = two
    with TestClient(create_app(settings)) as b:
        with TestClient(create_app(settings)) as a:
            api = Api(a, "").as_user("tester")
            model_id = api.model(api.session())
            trainer.release.clear()
            step = api.post("optim_step", {"model_id": model_id, "seq_id": 1,
                                           "adam_params": {"learning_rate": 0.25}}).json()
            assert trainer.started.acquire(timeout=10)
            a_instance = a.app.state.gateway.futures.instance
            row = b.app.state.gateway.db.get(FutureRow, step["request_id"])
            assert row.claimed_by == a_instance and row.request_body
        # Gateway a stopped with the optim_step pending: b claims it once the lease lapses and
        # sends the stored request again (the real trainer answers that resend from its first run).
        trainer.release.set()
        api_b = Api(b, api.api_key)
        result = api_b.result(step)
        assert result.status_code == 200 and "metrics" in result.json()
        sent = trainer.held
        assert len(sent) == 2 and sent[0] == sent[1] and sent[1].adam_params.learning_rate == 0.25
        row = b.app.state.gateway.db.get(FutureRow, step["request_id"])
        assert row.status == "complete" and row.claimed_by == b.app.state.gateway.futures.instance
        assert row.lease_until is None


def test_finished_futures_are_pruned_after_the_retention(two):
    from gateway import housekeeping

    trainer, sampler, settings = two
    with TestClient(create_app(settings)) as a:
        api = Api(a, "").as_user("tester")
        sid = _sampling_session(api)
        done = _sample(api, sid, 0)
        assert api.result({"request_id": done}).status_code == 200
        gw = a.app.state.gateway
        assert housekeeping.prune_futures(gw) == 0            # within the retention
        gw.settings.futures_retention_s = 0
        assert housekeeping.prune_futures(gw) == 1
        gw.futures._finished.clear()
        assert api.result({"request_id": done}).status_code == 404


def test_a_user_at_a_limit_on_one_gateway_is_at_it_on_the_other(two):
    """The limits count pending futures in the database, not per gateway process."""
    trainer, sampler, settings = two
    settings.max_samples_per_user, settings.max_queued_per_user = 1, 1
    with TestClient(create_app(settings)) as a, TestClient(create_app(settings)) as b:
        api_a = Api(a, "").as_user("tester")
        api_b = Api(b, api_a.api_key)
        other = Api(b, "").as_user("other")
        sid = _sampling_session(api_a)
        sampler.release.clear()
        held = _sample(api_a, sid, 0)
        r = api_b.post("asample", {"sampling_session_id": sid, "seq_id": 1, "num_samples": 1,
                                   "prompt": {"chunks": [{"type": "encoded_text", "tokens": [3, 4]}]}})
        assert r.status_code == 429 and "1 of your sample requests" in r.json()["error"], r.text
        assert r.headers["retry-after"]
        _sample(other, _sampling_session(other), 0)       # another user's limit is their own
        sampler.release.set()
        assert api_b.result({"request_id": held}).status_code == 200
        assert _sample(api_b, sid, 2)                     # freed on every gateway once it finished

        model_id = api_a.model(api_a.session())
        trainer.release.clear()
        api_a.post("optim_step", {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 0.1}})
        assert trainer.started.acquire(timeout=10)
        r = api_b.post("optim_step", {"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 0.1}})
        assert r.status_code == 429 and "training requests are queued" in r.json()["error"], r.text
        trainer.release.set()


def _closed_everywhere(api_a, api_b, model_id: str, session_id: str, sampler_id: str) -> None:
    """Each gateway refuses the closed session's training, sampling and heartbeats alike."""
    for path, body in (("optim_step", {"model_id": model_id, "seq_id": 9, "adam_params": {"learning_rate": 0.1}}),
                       ("asample", {"sampling_session_id": sampler_id, "seq_id": 9, "num_samples": 1,
                                    "prompt": {"chunks": [{"type": "encoded_text", "tokens": [3, 4]}]}})):
        on_a = assert_user_error(api_a.post(path, body), 400, "which was closed")
        assert assert_user_error(api_b.post(path, body), 400, "which was closed") == on_a
    for api in (api_a, api_b):
        assert api.post("session_heartbeat", {"session_id": session_id}).status_code == 410


def test_a_session_closed_on_one_gateway_is_closed_on_the_other(two, monkeypatch):
    trainer, sampler, settings = two
    settings.max_models_per_user = 1
    monkeypatch.setattr(db_module, "CACHE_TTL_S", 0.2)    # the staleness a close may have elsewhere
    with TestClient(create_app(settings)) as a, TestClient(create_app(settings)) as b:
        api_a = Api(a, "").as_user("tester")
        api_b = Api(b, api_a.api_key)
        session_id = api_a.session()
        model_id = api_a.model(session_id)
        sampler_id = api_a.post("create_sampling_session", {"session_id": session_id, "sampling_session_seq_id": 0,
                                                            "base_model": "tiny/base"}).json()["sampling_session_id"]
        step = api_b.post("optim_step", {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 0.1}})
        assert api_b.result(step.json()).status_code == 200       # b has read (and cached) the open session
        assert api_b.post("session_heartbeat", {"session_id": session_id}).status_code == 200
        assert api_a.post(f"sessions/{session_id}/finish").status_code == 200
        time.sleep(0.25)
        _closed_everywhere(api_a, api_b, model_id, session_id, sampler_id)
        assert api_b.post(f"sessions/{session_id}/finish").status_code == 200     # closing again is a no-op
        assert api_b.model(api_b.session())           # the closed session's run no longer counts on b


def _stable_reinforce_body(model_id: str, seq_id: int, sequence_id: str) -> bytes:
    """Prompt [3, 4, 5], sampled [5, 4, 3]: the targets are prompt [4, 5] then the whole sample,
    with the client's logprobs all 0 (the gateway puts in the sampler's)."""
    req = tw.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="stable_reinforce")
    datum = req.data.add()
    datum.model_input.add().encoded_text.tokens = np.asarray([3, 4, 5, 5, 4], "<i4").tobytes()
    for key, dtype, values in (("target_tokens", "<i8", [4, 5, 5, 4, 3]), ("logprobs", "<f4", [0.0] * 5),
                               ("advantages", "<f4", [1.0] * 5)):
        tensor = datum.loss_fn_inputs[key]
        tensor.dtype = tw.DTYPE_INT64 if dtype == "<i8" else tw.DTYPE_FLOAT32
        tensor.dense = np.asarray(values, dtype).tobytes()
    datum.loss_fn_input_spans.add().prompt_tokens.CopyFrom(tw.PromptProvenanceSpan(sequence_id=sequence_id,
                                                                                   offset=1, length=2))
    datum.loss_fn_input_spans.add().sampled_tokens.CopyFrom(tw.SampledProvenanceSpan(sequence_id=sequence_id,
                                                                                     offset=0, length=3))
    return req.SerializeToString()


def _forward_backward(api, model_id: str, seq_id: int, sequence_id: str):
    return api.client.post("/api/v1/forward_backward", headers={**PROTOBUF, "X-API-Key": api.api_key},
                           content=_stable_reinforce_body(model_id, seq_id, sequence_id))


def _recorded_sample(api, session_id: str) -> str:
    """Samples [3, 4, 5] once in the session, recorded for stable_reinforce: the sequence's id."""
    sid = api.post("create_sampling_session", {"session_id": session_id, "sampling_session_seq_id": 0,
                                               "base_model": "tiny/base"}).json()["sampling_session_id"]
    r = api.post("asample", {"sampling_session_id": sid, "seq_id": 0, "num_samples": 1,
                             "prompt": {"chunks": [{"type": "encoded_text", "tokens": [3, 4, 5]}]},
                             "sampling_params": {"max_tokens": 3}, "record_stability_info": True})
    assert api.result(r.json()).status_code == 200
    return r.json()["sample_sequence_ids"][0]


def test_stable_reinforce_on_one_gateway_finds_what_was_sampled_through_the_other(two):
    trainer, sampler, settings = two
    with TestClient(create_app(settings)) as a, TestClient(create_app(settings)) as b:
        api_a = Api(a, "").as_user("tester")
        api_b = Api(b, api_a.api_key)
        session_id = api_a.session()
        model_id = api_a.model(session_id)
        sequence_id = _recorded_sample(api_a, session_id)
        for api, seq_id in ((api_b, 1), (api_a, 2)):
            r = _forward_backward(api, model_id, seq_id, sequence_id)
            assert r.status_code == 200 and api.result(r.json()).status_code == 200, r.text
        on_b, on_a = trainer.of("ForwardBackward")[-2:]
        assert to_numpy(on_b.data[0].loss_fn_inputs["logprobs"]).tolist() == [0.0, 0.0, -1.0, -1.0, -1.0]
        on_b.seq_id = on_a.seq_id
        assert on_b == on_a                            # b built the very request a builds
        other_model = api_b.model(api_b.session(), model_seq_id=1)    # records belong to their session
        assert_user_error(_forward_backward(api_b, other_model, 1, sequence_id), 400, "no stability record")


def test_a_session_known_empty_on_one_gateway_hears_of_a_sample_finished_on_the_other(two, monkeypatch):
    """SQLite, every message between the gateways lost (the net under them): gateway b looked at a
    sampling session and found it empty, so its next polls for that session answer without a
    look. A sample then finishes on gateway a while no poll waits on b: b's watcher still reads
    the new rows (every 0.5 s while a session is known empty), so b's acknowledgement-only poll
    afterwards looks, and reports it; and a long poll on b for a second sample hears of it within
    a look of the watcher."""
    monkeypatch.setattr(Peers, "committed", lambda self, *finish: None)
    trainer, sampler, settings = two
    with TestClient(create_app(settings)) as a, TestClient(create_app(settings)) as b:
        api_a = Api(a, "").as_user("tester")
        api_b = Api(b, api_a.api_key)
        sid = _sampling_session(api_a)
        body = {"target": {"type": "sampling_session", "sampling_session_id": sid, "cloned_sampler_id": 0},
                "prev_cursor": 0, "timeout": 0}
        assert api_b.post("retrieve_futures", body).json() == {"completions": [], "cursor": 0}
        first = _sample(api_a, sid, 0)
        deadline = time.monotonic() + 10
        while a.app.state.gateway.futures.pending("sample"):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(2.0)          # b's watcher has looked since (the sample's row is older than its lag)
        answer = api_b.post("retrieve_futures", body).json()
        assert [c["request_id"] for c in answer["completions"]] == [first]
        cursor = answer["cursor"]
        assert api_b.post("retrieve_futures", {**body, "prev_cursor": cursor}).json()["completions"] == []
        sampler.release.clear()
        second = _sample(api_a, sid, 1)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(api_b.post, "retrieve_futures", {**body, "prev_cursor": cursor, "timeout": 20.0})
            time.sleep(0.3)
            assert not waiting.done()
            released = time.monotonic()
            sampler.release.set()
            answer = waiting.result(timeout=20).json()
        assert [c["request_id"] for c in answer["completions"]] == [second]
        assert time.monotonic() - released < 2.0


def _listening(*clients) -> None:
    deadline = time.monotonic() + 10
    while not all(c.app.state.gateway.futures.peers.listening for c in clients):
        assert time.monotonic() < deadline, "a gateway never listened to the others"
        time.sleep(0.02)


def _woken_at_once(a, b, trainer, sampler) -> None:
    """A retrieve_future waiting on b for an optim_step running on a, and a retrieve_futures poll
    on b for a sample running on a, answer within 2 s of a finishing them (the nets' next look at
    the rows is 30 s away)."""
    _listening(a, b)
    time.sleep(0.6)          # b's look at the rows in flight at its start is over
    api_a = Api(a, "").as_user("tester")
    api_b = Api(b, api_a.api_key)
    model_id = api_a.model(api_a.session())
    sid = _sampling_session(api_a)
    trainer.release.clear()
    sampler.release.clear()
    step = api_a.post("optim_step", {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 0.1}})
    sample = _sample(api_a, sid, 0)
    assert trainer.started.acquire(timeout=10)
    body = {"target": {"type": "sampling_session", "sampling_session_id": sid, "cloned_sampler_id": 0},
            "prev_cursor": 0, "timeout": 20.0}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        result = pool.submit(api_b.result, step.json())
        poll = pool.submit(api_b.post, "retrieve_futures", body)
        time.sleep(0.5)
        assert not result.done() and not poll.done()
        released = time.monotonic()
        trainer.release.set()
        answer = result.result(timeout=20)
        trained_s = time.monotonic() - released
        released = time.monotonic()
        sampler.release.set()
        polled = poll.result(timeout=20).json()
        sampled_s = time.monotonic() - released
    assert answer.status_code == 200 and "metrics" in answer.json(), answer.text
    assert [c["request_id"] for c in polled["completions"]] == [sample]
    assert trained_s < 2.0 and sampled_s < 2.0, (trained_s, sampled_s)      # the message, not the nets


def test_what_one_gateway_finishes_wakes_the_others_waiters_at_once(two, monkeypatch):
    """SQLite: the gateway finishing a future sends a datagram to each other gateway on the
    database file (gateway/futures/peers.py), whose waiters answer at once."""
    monkeypatch.setattr(waits_module, "NET_S", 30.0)
    monkeypatch.setattr(completions_module, "NET_S", 30.0)
    trainer, sampler, settings = two
    with TestClient(create_app(settings)) as a, TestClient(create_app(settings)) as b:
        _woken_at_once(a, b, trainer, sampler)


def test_gateways_that_cannot_make_their_sockets_start_and_answer_each_other_by_the_rows(two, monkeypatch, caplog):
    """SQLite where no Unix socket can be made (no /proc, a filesystem without sockets): each
    gateway says so and starts; a result one finishes reaches a waiter on the other by its net."""
    def no_sockets(self):
        raise OSError(95, "Operation not supported")
    monkeypatch.setattr(Peers, "_bind", no_sockets)
    trainer, sampler, settings = two
    with caplog.at_level("WARNING", logger="gateway.futures.peers"):
        with TestClient(create_app(settings)) as a, TestClient(create_app(settings)) as b:
            assert not a.app.state.gateway.futures.peers.listening
            api_a = Api(a, "").as_user("tester")
            api_b = Api(b, api_a.api_key)
            sid = _sampling_session(api_a)
            sampler.release.clear()
            held = _sample(api_a, sid, 0)
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                waiting = pool.submit(api_b.result, {"request_id": held})
                time.sleep(0.3)
                assert not waiting.done()
                released = time.monotonic()
                sampler.release.set()
                answer = waiting.result(timeout=20)
            assert answer.status_code == 200 and time.monotonic() - released < 2.0
    assert "will not hear each other's finishes at once (OSError" in caplog.text, caplog.text


def test_a_killed_gateways_socket_is_removed_by_the_first_sender_it_refuses(tmp_path):
    """SQLite: a gateway killed leaves its socket in `<database>.gateways/`. The next gateway to
    finish a future finds nobody reading it and removes it; a live gateway hears the message."""
    import asyncio
    import socket

    from gateway.storage.db import Database

    db = Database(f"sqlite:///{tmp_path / 'db.sqlite'}")
    sockets = tmp_path / "db.sqlite.gateways"

    async def main():
        heard = asyncio.Queue()
        sender, other = Peers(db.engine, "sender"), Peers(db.engine, "other")
        stops = [sender.listen(lambda *a: None), other.listen(lambda *a: heard.put_nowait(a))]
        killed, directory = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM), os.open(sockets, os.O_PATH)
        killed.bind(f"/proc/self/fd/{directory}/0123456789abcdef.sock")     # a socket's path has 107 bytes at most
        killed.close()                   # its file stays, as a SIGKILL leaves it
        os.close(directory)
        assert len(list(sockets.iterdir())) == 3
        sender.committed("r1", ("session-1", 2), 3)
        assert await asyncio.wait_for(heard.get(), 10) == ("r1", ("session-1", 2), 3)
        sender.committed("r2", None)
        assert await asyncio.wait_for(heard.get(), 10) == ("r2", None, 0)
        await _until(lambda: not (sockets / "0123456789abcdef.sock").exists())
        for stop in stops:
            stop()
        await _until(lambda: list(sockets.iterdir()) == [])        # each removes its own as it stops
    asyncio.run(main())


async def _until(predicate, timeout_s: float = 10) -> None:
    import asyncio

    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)


def test_what_one_gateway_finishes_wakes_the_others_waiters_at_once_by_its_notice(tmp_path, monkeypatch):
    """PostgreSQL: the transaction finishing a future sends a notice on commit, and every other
    gateway's listener wakes its waiters at once (gateways on other hosts included)."""
    pytest.importorskip("pgserver")
    from harness.postgres import postgres

    monkeypatch.setattr(waits_module, "NET_S", 30.0)
    monkeypatch.setattr(completions_module, "NET_S", 30.0)
    trainer, sampler = HeldTrainer(str(tmp_path / "state")), HeldSampler()
    with postgres(tmp_path / "pg", "tinkerd") as url, fake_services(tmp_path, trainer, sampler, db_url=url) as settings:
        try:
            with TestClient(create_app(settings)) as a, TestClient(create_app(settings)) as b:
                _woken_at_once(a, b, trainer, sampler)
        finally:
            trainer.release.set()
            sampler.release.set()
