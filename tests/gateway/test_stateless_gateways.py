"""Two gateways on one database (fake backends): a future accepted by one is answered by the
other, and a gateway that stops renewing its lease has its pending futures claimed and re-driven
by the other, from the request stored in the row."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest
from fastapi.testclient import TestClient
from gateway_fakes import Api, FakeTrainer, fake_services
from test_futures_routes import HeldSampler, _sample, _sampling_session

from gateway.app import create_app
from gateway.db import FutureRow


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
