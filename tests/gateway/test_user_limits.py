"""Per-user limits under bursts and across gateways (issue 24, M1/M3/M6): a limit counts what a
request adds in the transaction that adds it, so exactly the limit gets through however the
requests are spread over threads and gateways; noop futures are admins'; sessions, sampling
sessions and the disk quota (snapshots and queued saves included) are capped; closed sessions
are pruned; unpublishing a checkpoint cuts off the sampling sessions others made from it."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest
from fastapi.testclient import TestClient
from gateway_fakes import Api, FakeSampler, FakeTrainer, assert_user_error, fake_services, internal_client
from gateway_fakes import gateway  # noqa: F401 - the fixture

from gateway import housekeeping
from gateway.app import create_app
from gateway.identity.keys import Caller, create_user
from gateway.futures.store import FutureStore
from gateway.identity.limits import Limits, OverLimit, pending_samples_in, pending_training_in
from gateway.settings import GatewaySettings
from gateway.storage.db import Database, FutureRow, SessionRow
from tinkerd.errors import UserError
from tinkerd.rpc import TENANT_METADATA


class HeldTrainer(FakeTrainer):
    """CreateModel and PushWeights wait for their gate; every call records the tenant it names."""

    def __init__(self, state_dir):
        super().__init__(state_dir)
        self.create_gate, self.push_gate = threading.Event(), threading.Event()
        self.create_gate.set()
        self.push_gate.set()
        self.tenants: list[tuple[str, str]] = []

    def _tenant(self, name, context):
        self.tenants.append((name, dict(context.invocation_metadata()).get(TENANT_METADATA, "")))

    def CreateModel(self, request, context):
        self._tenant("CreateModel", context)
        self.create_gate.wait(30)
        return super().CreateModel(request, context)

    def OptimStep(self, request, context):
        self._tenant("OptimStep", context)
        return super().OptimStep(request, context)

    def PushWeights(self, request, context):
        self._tenant("PushWeights", context)
        self.push_gate.wait(30)
        return super().PushWeights(request, context)


@pytest.fixture
def held(tmp_path):
    trainer = HeldTrainer(str(tmp_path / "state"))
    with fake_services(tmp_path, trainer, FakeSampler()) as settings:
        try:
            yield trainer, settings
        finally:
            trainer.create_gate.set()
            trainer.push_gate.set()


def _create(api: Api, session_id: str, seq: int):
    return api.post("create_model", {"session_id": session_id, "model_seq_id": seq, "base_model": "tiny/base",
                                     "lora_config": {"rank": 8}})


def test_a_burst_of_create_model_over_two_gateways_gets_exactly_the_model_cap(held):
    """Measured before: with --max-models-per-user 4, 9 create_model in a burst were all
    accepted (runs counted only once the trainer had made them)."""
    trainer, settings = held
    settings.max_models_per_user = 4
    with TestClient(create_app(settings)) as a, TestClient(create_app(settings)) as b:
        api_a = Api(a, "").as_user("tester")
        api_b = Api(b, api_a.api_key)
        session_id = api_a.session()
        trainer.create_gate.clear()              # none is made while the burst comes in
        with concurrent.futures.ThreadPoolExecutor(9) as pool:
            replies = list(pool.map(lambda i: _create((api_a, api_b)[i % 2], session_id, i), range(9)))
        accepted = [r for r in replies if r.status_code == 200]
        refused = [r for r in replies if r.status_code != 200]
        assert len(accepted) == 4, [r.text for r in replies]
        for r in refused:
            assert_user_error(r, 400, "limit 4", "--max-models-per-user", "close a ServiceClient")
        trainer.create_gate.set()
        for r in accepted:
            assert api_a.result(r.json()).status_code == 200
        assert_user_error(_create(api_b, session_id, 20), 400, "--max-models-per-user")   # made: still 4
        assert api_a.post(f"sessions/{session_id}/finish").status_code == 200
        assert api_b.model(api_b.session(), model_seq_id=0)         # the closed session's runs no longer count


def test_a_create_model_the_trainer_refuses_frees_its_place(gateway):
    gateway.settings.max_models_per_user = 1
    gateway.settings.max_lora_rank = 100          # the gateway lets it through; the fake trainer refuses rank > 64
    api = gateway.api
    session_id = api.session()
    failed = api.post("create_model", {"session_id": session_id, "model_seq_id": 0, "base_model": "tiny/base",
                                       "lora_config": {"rank": 65}})
    result = api.result(failed.json()).json()       # a failed future
    assert result["category"] == "user" and "rank" in result["error"], result
    assert api.model(session_id, model_seq_id=1)


def _admit_all(url: str, settings: GatewaySettings, request_type: str, n: int) -> tuple[int, list[Exception]]:
    """n futures of one user inserted at once by n threads over two Database objects (two
    gateways) on `url`, each admitted by the limits: (how many got in, the refusals)."""
    dbs = [Database(url), Database(url)]
    user = create_user(dbs[0], "burst")
    caller = Caller(user.user_id, user.name, user.org_id, "", False, key_id="")
    dbs[0].add(SessionRow(session_id="sess-burst", owner=user.user_id))
    limits = [Limits(settings, db) for db in dbs]
    start = threading.Barrier(n)

    def insert(i: int):
        model_id = f"sess-burst:train:{i}"
        row = FutureRow(request_id=f"r{i}", idempotency_key=f"{model_id}#0", owner=user.user_id,
                        request_type=request_type, model_id=model_id, extra={}, request_args={})
        start.wait()
        try:
            FutureStore(dbs[i % 2]).insert(row, limits[i % 2].admit_training(caller, request_type, model_id))
        except (UserError, OverLimit) as e:
            return e
        return None

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        outcomes = list(pool.map(insert, range(n)))
    with dbs[0].engine.connect() as conn:
        written = pending_training_in(conn, user.user_id)
    refusals = [e for e in outcomes if e is not None]
    assert written == n - len(refusals)          # a refused request left nothing behind
    return written, refusals


@pytest.mark.parametrize("request_type, cap, flag, refusal", [("create_model", 4, "--max-models-per-user", UserError),
                                                               ("optim_step", 5, "--max-queued-per-user", OverLimit)])
def test_concurrent_submissions_on_two_gateways_pass_exactly_the_cap(db_url, tmp_path, request_type, cap, flag,
                                                                     refusal):
    settings = GatewaySettings(base_model="m", trainer="t", state_dir=str(tmp_path), max_models_per_user=100,
                               max_queued_per_user=100)
    setattr(settings, "max_models_per_user" if request_type == "create_model" else "max_queued_per_user", cap)
    made, refusals = _admit_all(db_url, settings, request_type, 12)
    assert made == cap and len(refusals) == 12 - cap
    assert all(isinstance(e, refusal) and flag in str(e) for e in refusals), refusals


def test_noop_future_is_for_admins_and_counts_in_their_queue(gateway):
    """On the internal listener (gateway/listeners.py), and there for admins only."""
    api = gateway.api
    internal = internal_client(api.client)
    assert api.client.post("/internal/noop_future").status_code == 404        # not on the public port
    r = internal.post("/internal/noop_future", headers={"X-API-Key": api.api_key})
    assert r.status_code == 403 and "admin" in r.json()["error"]
    admin = api.as_user("boss", admin=True)
    r = internal.post("/internal/noop_future", headers={"X-API-Key": admin.api_key})
    assert r.status_code == 200 and admin.result(r.json()).json() == {"type": "noop"}
    gateway.settings.max_queued_per_user = 0
    r = internal.post("/internal/noop_future", headers={"X-API-Key": admin.api_key})
    assert r.status_code == 429 and "--max-queued-per-user" in r.json()["error"] and r.headers["retry-after"]


def test_the_trainer_is_told_whose_request_it_runs(held):
    """The fair scheduler's tenant is the owner: one user's sessions share one share."""
    trainer, settings = held
    with TestClient(create_app(settings)) as client:
        alice, bob = Api(client, "").as_user("alice"), Api(client, "").as_user("bob")
        for api in (alice, alice, bob):
            model = api.model(api.session())
            assert api.result(api.post("optim_step", {"model_id": model, "seq_id": 1}).json()).status_code == 200
    tenants = [t for _, t in trainer.tenants]
    assert len(tenants) == 6 and all(t.startswith("user:") for t in tenants), trainer.tenants
    assert tenants[0] == tenants[1] == tenants[2] == tenants[3] != tenants[4] == tenants[5], tenants


def test_open_sessions_are_capped_and_a_closed_one_frees_its_place(gateway):
    gateway.settings.max_sessions_per_user = 2
    api = gateway.api
    first, _ = api.session(), api.session()
    assert_user_error(api.post("create_session", {"tags": []}), 400, "limit 2", "--max-sessions-per-user",
                      "/finish")
    assert api.as_user("other").session()                 # another user's count is their own
    assert api.post(f"sessions/{first}/finish").status_code == 200
    assert api.session()


def test_sampling_sessions_are_capped_per_user(gateway):
    gateway.settings.max_sampling_sessions_per_user = 1
    api = gateway.api
    session_id = api.session()
    body = {"session_id": session_id, "sampling_session_seq_id": 0, "base_model": "tiny/base"}
    assert api.post("create_sampling_session", body).status_code == 200
    assert api.post("create_sampling_session", body).status_code == 200     # the same one, resent
    assert_user_error(api.post("create_sampling_session", {**body, "sampling_session_seq_id": 1}), 400,
                      "limit 1", "--max-sampling-sessions-per-user")
    model = api.model(session_id)                           # save_weights_and_get_sampling_client still works
    saved = api.post("save_weights_for_sampler", {"model_id": model, "seq_id": 1, "sampling_session_seq_id": 5})
    assert api.result(saved.json()).status_code == 200


def test_closed_sessions_are_pruned_after_the_retention_unless_they_hold_checkpoints(gateway):
    api = gateway.api
    gw = api.client.app.state.gateway
    plain, kept = api.session(), api.session()
    model = api.model(plain)
    sampler = api.post("create_sampling_session", {"session_id": plain, "sampling_session_seq_id": 0,
                                                   "base_model": "tiny/base"}).json()["sampling_session_id"]
    saved_model = api.model(kept)
    assert api.result(api.post("save_weights", {"model_id": saved_model, "seq_id": 1, "path": "c"}).json()).status_code == 200
    for session_id in (plain, kept):
        assert api.post(f"sessions/{session_id}/finish").status_code == 200
    assert housekeeping.prune_sessions(gw) == 0            # within --closed-session-retention-s
    gw.settings.closed_session_retention_s = 0
    assert housekeeping.prune_sessions(gw) == 1
    assert api.get(f"sessions/{plain}").status_code == 404
    assert api.post("get_info", {"model_id": model}).status_code == 404
    assert api.get(f"samplers/{sampler}").status_code == 404
    assert api.get(f"sessions/{kept}").status_code == 200   # its run holds a checkpoint
    assert api.post("get_info", {"model_id": saved_model}).status_code == 200


def test_snapshots_count_in_the_disk_quota_and_queued_saves_reserve_it(held):
    """The fake trainer's snapshots are 123 bytes; the quota here is 300 bytes."""
    trainer, settings = held
    settings.max_checkpoint_gb_per_user = 300e-9
    with TestClient(create_app(settings)) as client:
        api = Api(client, "").as_user("tester")
        model = api.model(api.session())

        def snapshot(seq: int):
            return api.post("save_weights_for_sampler", {"model_id": model, "seq_id": seq,
                                                         "sampling_session_seq_id": seq})
        trainer.push_gate.clear()
        first = snapshot(1)
        r = snapshot(2)               # the first one's size is not known yet: one at a time
        assert r.status_code == 429 and "first checkpoint save" in r.json()["error"] and r.headers["retry-after"]
        trainer.push_gate.set()
        assert api.result(first.json()).status_code == 200          # 123 bytes held
        trainer.push_gate.clear()
        queued = [snapshot(2)]                                       # reserves 123: 246 < 300
        r = snapshot(3)                                              # 123 + 123 reserved + this one's
        assert r.status_code == 200, r.text
        queued.append(r)
        assert_user_error(snapshot(4), 400, "0.00 GB", "2 queued saves", "--max-checkpoint-gb-per-user")
        trainer.push_gate.set()
        for r in queued:
            assert api.result(r.json()).status_code == 200
        # 369 bytes of snapshots held now: over the quota, for named checkpoints too.
        assert_user_error(api.post("save_weights", {"model_id": model, "seq_id": 9, "path": "c"}), 400,
                          "checkpoints and snapshots hold", "--max-checkpoint-gb-per-user")


def test_unpublishing_cuts_off_the_sampling_sessions_others_made(gateway):
    alice = gateway.api
    bob = alice.as_user("bob")
    model = alice.model(alice.session())
    saved = alice.result(alice.post("save_weights_for_sampler", {"model_id": model, "seq_id": 1,
                                                                 "path": "pub"}).json()).json()
    path = saved["path"]
    alice.post(f"training_runs/{model}/checkpoints/sampler_weights/pub/publish")
    sampler = bob.post("create_sampling_session", {"session_id": bob.session(), "sampling_session_seq_id": 0,
                                                   "model_path": path}).json()["sampling_session_id"]
    body = {"sampling_session_id": sampler, "num_samples": 1, "sampling_params": {"max_tokens": 2},
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [3, 4]}]}}
    assert bob.result(bob.post("asample", {**body, "seq_id": 0}).json()).status_code == 200
    assert alice.client.delete(f"/api/v1/training_runs/{model}/checkpoints/sampler_weights/pub/publish",
                               headers={"X-API-Key": alice.api_key}).status_code == 200
    assert_user_error(bob.post("asample", {**body, "seq_id": 1}), 404, "unpublished")
    own = alice.post("create_sampling_session", {"session_id": alice.session(), "sampling_session_seq_id": 0,
                                                 "model_path": path}).json()["sampling_session_id"]
    assert alice.post("asample", {**body, "sampling_session_id": own, "seq_id": 0}).status_code == 200
    assert alice.client.delete(f"/api/v1/training_runs/{model}/checkpoints/sampler_weights/pub",
                               headers={"X-API-Key": alice.api_key}).status_code == 200
    assert_user_error(alice.post("asample", {**body, "sampling_session_id": own, "seq_id": 1}), 404, "deleted")


def test_a_burst_of_samples_over_two_gateways_passes_neither_sample_cap(db_url, tmp_path):
    """Measured before: the sample caps were counted, then the future inserted after an await, so
    a burst of 40 OpenAI completions under a cap of 4 admitted 5. Now each sample is counted in
    its insert's transaction, the server-wide count one sample at a time over every user."""
    settings = GatewaySettings(base_model="m", trainer="t", state_dir=str(tmp_path), max_samples_per_user=4,
                               max_pending_samples=10)
    dbs = [Database(db_url), Database(db_url)]
    users = [create_user(dbs[0], f"sampler-{i}") for i in range(3)]
    limits = [Limits(settings, db) for db in dbs]
    n = 36
    start = threading.Barrier(n)

    def insert(i: int):
        user = users[i % 3]
        caller = Caller(user.user_id, user.name, user.org_id, "", False, key_id="")
        row = FutureRow(request_id=f"s{i}", owner=user.user_id, request_type="sample", extra={}, request_args={})
        start.wait()
        try:
            FutureStore(dbs[i % 2]).insert(row, limits[i % 2].admit_sample(caller))
        except OverLimit as e:
            return e
        return None

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        refusals = [e for e in pool.map(insert, range(n)) if e is not None]
    with dbs[0].engine.connect() as conn:
        per_user = [pending_samples_in(conn, u.user_id)[1] for u in users]
        total = pending_samples_in(conn, users[0].user_id)[0]
    assert total == 10 == n - len(refusals), (total, per_user, refusals)
    assert all(n <= 4 for n in per_user), per_user
    assert all("--max-pending-samples" in str(e) or "of your sample requests" in str(e) for e in refusals)
