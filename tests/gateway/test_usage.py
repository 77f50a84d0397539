"""Usage for chargeback on fake backends (the SDK, its CLI and a real stack:
tests/e2e/test_management.py): a known workload's tokens, checkpoints and storage in the SDK's
shapes, each piece of work counted once however often it runs, who sees whose usage, prices, and
the windows that are refused."""

from __future__ import annotations

import datetime
import types

import pytest
from fastapi.testclient import TestClient
from gateway_fakes import FakeSampler, FakeTrainer, Api, assert_user_error, fake_services, gateway  # noqa: F401
from sqlalchemy import select
from tinker import types as sdk
from test_console_routes import PROTOBUF, _fwdbwd_body
from test_futures_routes import HeldSampler, _sample, _sampling_session

from gateway import billing, usage
from gateway.app import create_app
from gateway.storage.db import CheckpointStorageRow, now
from tinkerd.v1 import common_pb2, trainer_pb2


def _window(hours: int = 1) -> dict:
    start = usage.hour_of(now())
    return {"starting_on": start.isoformat(), "ending_before": (start + datetime.timedelta(hours=hours)).isoformat()}


def _workload(api) -> dict:
    """Two forward_backwards and a forward of 3 tokens each, a sample of 2 from a 3-token prompt
    (the fake answers the prompt reversed, cut to max_tokens 2), one save_state (10 bytes)."""
    session = api.post("create_session", {"tags": [], "project_id": "proj-u", "user_metadata": {"team": "rl"}}).json()[
        "session_id"]
    model = api.model(session)
    for seq, forward_only in ((1, False), (2, False), (3, True)):
        fb = api.client.post("/api/v1/forward_backward", headers={**PROTOBUF, "X-API-Key": api.api_key},
                             content=_fwdbwd_body(model, seq, [5, 6, 7], [1.0, 1.0, 1.0], forward_only))
        assert api.result(fb.json()).status_code == 200
    saved = api.post("save_weights", {"model_id": model, "seq_id": 4, "path": "state-1"}).json()
    path = api.result(saved).json()["path"]
    sid = api.post("create_sampling_session", {"session_id": session, "sampling_session_seq_id": 0,
                                               "base_model": "tiny/base"}).json()["sampling_session_id"]
    sample = api.post("asample", {"sampling_session_id": sid, "seq_id": 0, "num_samples": 2,
                                  "prompt": {"chunks": [{"type": "encoded_text", "tokens": [3, 4, 5]}]},
                                  "sampling_params": {"max_tokens": 2}}).json()
    assert api.result(sample).status_code == 200
    return {"session": session, "model": model, "path": path}


def _totals(response: dict) -> dict:
    out: dict = {}
    for event in response["data"]:
        info = event["event_info"]
        value = info.get("token_count", info.get("count", info.get("gigabyte_hours")))
        out[info["type"]] = out.get(info["type"], 0) + value
    return out


def test_a_known_workload_is_counted_in_the_sdks_shapes(gateway):
    api = gateway.api
    work = _workload(api)
    got = api.get("billing/usage/events", params=_window())
    assert got.status_code == 200, got.text
    body = got.json()
    sdk.BillingUsageResponse.model_validate(body)          # the SDK parses it
    totals = _totals(body)
    assert {k: v for k, v in totals.items() if k != "storage"} == {
        "training": 9, "sampling_prefill": 3, "sampling_sample": 4, "checkpoint": 1}
    assert 0 < totals["storage"] < 10 / 1e9                # 10 bytes for under an hour
    for event in body["data"]:
        assert (event["session_id"], event["project_id"], event["user_name"]) == (work["session"], "proj-u", "tester")
        assert event["estimated_cost_usd"] is None                     # no prices given
        assert event["user_id"].startswith("tml:organization_user:")
    assert body["sessions"] == {work["session"]: {"user_metadata": {"team": "rl"}}}
    assert [e["event_info"]["cached"] for e in body["data"] if e["event_info"]["type"] == "sampling_prefill"] == [False]

    current = api.get("billing/usage/checkpoints/current").json()
    sdk.CurrentCheckpointStorageUsageResponse.model_validate(current)
    assert [(r["project_id"], r["checkpoint_count"], r["size_bytes"], r["user_name"]) for r in current["data"]] == [
        ("proj-u", 1, 10, "tester")]

    # Moved, the session's usage is its new project's; deleted, the checkpoint stores nothing now.
    api.request("PUT", f"sessions/{work['session']}/project", json={"project_id": "proj-v"})
    assert {e["project_id"] for e in api.get("billing/usage/events", params=_window()).json()["data"]} == {"proj-v"}
    assert api.get("billing/usage/checkpoints/current", params={"project_id": "proj-v"}).json()["data"][0][
        "checkpoint_count"] == 1
    run = work["path"][len("tinker://"):].split("/")[0]
    assert api.request("DELETE", f"training_runs/{run}/checkpoints/weights/state-1").status_code == 200
    assert api.get("billing/usage/checkpoints/current").json()["data"] == []


def test_who_sees_whose_usage(gateway):
    api = gateway.api
    _workload(api)
    bob, root = api.as_user("bob"), api.as_user("root", admin=True)
    assert bob.get("billing/usage/events", params=_window()).json()["data"] == []
    assert bob.get("billing/usage/checkpoints/current").json()["data"] == []
    assert _totals(root.get("billing/usage/events", params=_window()).json())["training"] == 9
    other_org = api.as_user("eve", admin=True, org_id="elsewhere")
    assert other_org.get("billing/usage/events", params=_window()).json()["data"] == []
    assert_user_error(bob.get("billing/usage/checkpoints/current", params={"project_id": "proj-u"}), 400, "proj-u")


def test_work_run_again_is_counted_once(gateway):
    """A re-driven forward_backward, a sample answered twice, a save run again: nothing more."""
    api = gateway.api
    work = _workload(api)
    db = api.client.app.state.gateway.db
    before = _totals(api.get("billing/usage/events", params=_window()).json())
    again = trainer_pb2.ForwardBackwardRequest(model_id=work["model"], seq_id=1, data=[common_pb2.Datum(tokens=[5, 6, 7])])
    with db.engine.begin() as conn:          # as the re-run's future would be finished
        assert not usage.add(conn, usage.trained(again)(conn))
    sample_key = next(k for k in db.select(select(usage.UsageCountedRow.key)) if k.startswith("sample:"))
    usage._count_sample(db, "tiny/base", sample_key.removeprefix("sample:"), 3, 4)
    usage._checkpoint_made(db, work["path"], f"{work['model']}#4")
    after = _totals(api.get("billing/usage/events", params=_window()).json())
    assert {k: v for k, v in after.items() if k != "storage"} == {k: v for k, v in before.items() if k != "storage"}
    assert len(db.select(select(CheckpointStorageRow))) == 1
    assert usage.count(db, usage.Work("fresh", "u", "", "m", (("training", False, 5),)))
    assert not usage.count(db, usage.Work("fresh", "u", "", "m", (("training", False, 5),)))


def test_a_sample_re_driven_by_another_gateway_is_counted_once(tmp_path):
    """Gateway a stops while its sample is at the replica (nothing counted there); gateway b on the
    same database claims it once a's lease lapses, runs it again, and counts it: once."""
    trainer, sampler = FakeTrainer(str(tmp_path / "state")), HeldSampler()
    with fake_services(tmp_path, trainer, sampler, future_lease_s=0.3) as settings, \
            TestClient(create_app(settings)) as b:
        with TestClient(create_app(settings)) as a:
            api = Api(a, "").as_user("tester")
            sid = _sampling_session(api)
            sampler.release.clear()
            request_id = _sample(api, sid, 0)
            assert sampler.started.acquire(timeout=10)
        sampler.release.set()
        api_b = Api(b, api.api_key)
        assert api_b.result({"request_id": request_id}).status_code == 200
        assert _totals(api_b.get("billing/usage/events", params=_window()).json()) == {
            "sampling_prefill": 2, "sampling_sample": 2}


@pytest.mark.parametrize("params, words", [
    ({"starting_on": "2026-01-01T00:00:00Z", "ending_before": "2026-01-16T00:00:00Z"}, ["14 days"]),
    ({"starting_on": "2026-01-01T00:30:00Z", "ending_before": "2026-01-02T00:00:00Z"}, ["starting_on", "hour"]),
    ({"starting_on": "2026-01-01T00:00:00Z", "ending_before": "2026-01-02T00:00:01Z"}, ["ending_before", "hour"]),
    ({"starting_on": "2026-01-01T00:00:00", "ending_before": "2026-01-02T00:00:00Z"}, ["starting_on", "time zone"]),
    ({"starting_on": "2026-01-02T00:00:00Z", "ending_before": "2026-01-01T00:00:00Z"}, ["must be after"]),
    ({"starting_on": "2999-01-01T00:00:00Z", "ending_before": "2999-01-02T00:00:00Z"}, ["future"]),
    ({"starting_on": "2026-01-01T00:00:00Z"}, ["ending_before"]),
])
def test_a_window_the_sdk_does_not_allow_is_a_400_naming_it(gateway, params, words):
    assert_user_error(gateway.api.get("billing/usage/events", params=params), 400, *words)


def test_prices_give_costs(tmp_path):
    prices = {"price_training_per_mtok": 2.0, "price_prefill_per_mtok": 0.5, "price_sampled_per_mtok": 4.0,
              "price_storage_per_gb_month": 720.0}
    trainer, sampler = FakeTrainer(str(tmp_path / "state")), FakeSampler()
    with fake_services(tmp_path, trainer, sampler, **prices) as settings, TestClient(create_app(settings)) as client:
        api = Api(client, "").as_user("tester")
        _workload(api)
        body = api.get("billing/usage/events", params=_window()).json()
    costs = {e["event_info"]["type"]: (e["estimated_cost_usd"], e.get("effective_rate_usd_per_million_tokens"))
             for e in body["data"]}
    assert costs["training"] == pytest.approx((2.0 * 9 / 1e6, 2.0))
    assert costs["sampling_prefill"] == pytest.approx((0.5 * 3 / 1e6, 0.5))
    assert costs["sampling_sample"] == pytest.approx((4.0 * 4 / 1e6, 4.0))
    assert costs["checkpoint"] == (None, None)
    storage = next(e for e in body["data"] if e["event_info"]["type"] == "storage")
    assert storage["estimated_cost_usd"] == pytest.approx(storage["event_info"]["gigabyte_hours"])   # 720 / 720


def test_storage_gigabyte_hours_split_by_hour():
    """2 GB from 00:30 to 02:15: 1 GB-h in hour 0, 2 in hour 1, 0.5 in hour 2."""
    t0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
    row = CheckpointStorageRow(tinker_path="p", since=t0 + datetime.timedelta(minutes=30),
                               until=t0 + datetime.timedelta(hours=2, minutes=15), size_bytes=2 * 10**9,
                               owner="u", session_id="s", base_model="m")
    db = types.SimpleNamespace(select=lambda stmt: [row])
    caller = types.SimpleNamespace(admin=False, user_id="u")
    hours = billing._storage_hours(db, caller, t0, t0 + datetime.timedelta(hours=5))
    assert {k[0].hour: v for k, v in hours.items()} == pytest.approx({0: 1.0, 1: 2.0, 2: 0.5})


def test_counting_in_a_transaction_on_either_database(db_url):
    """The statements a finishing sample runs (usage.add): a key counts once; one hour's work of
    a session adds up in one bucket, named by the session's project as it is when counted."""
    from sqlalchemy import update

    from gateway.storage.db import Database, SessionRow, UsageRow

    db = Database(db_url)
    db.add(SessionRow(session_id="s1", owner="u", project_id="proj-a"))
    sample = usage.Work("sample:r1", "u", "s1", "m", (("sampling_prefill", False, 3), ("sampling_sample", False, 4)))
    with db.engine.begin() as conn:
        assert usage.add(conn, sample)
        assert not usage.add(conn, sample)             # the same key again: nothing
    with db.engine.begin() as conn:
        conn.execute(update(SessionRow).where(SessionRow.session_id == "s1").values(project_id="proj-b"))
    assert usage.count(db, usage.Work("sample:r2", "u", "s1", "m", (("sampling_sample", False, 5),)))
    assert usage.count(db, usage.Work("sample:r3", "u", "", "m", (("sampling_sample", False, 2),)))   # OpenAI's
    rows = {(r.session_id, r.kind): (r.quantity, r.project_id) for r in db.select(select(UsageRow))}
    assert rows == {("s1", "sampling_prefill"): (3, "proj-a"), ("s1", "sampling_sample"): (9, "proj-b"),
                    ("", "sampling_sample"): (2, None)}


def test_a_save_is_written_in_one_transaction_or_not_at_all(db_url, tmp_path, monkeypatch):
    """A save's checkpoint row, its audit entry, its storage interval and its count commit
    together (gateway/jobs/weights.py _saved, _write_saved): once each; saved again at the path under the same
    key, the row and interval are replaced and nothing more is counted; and a save whose writes
    fail part way leaves none of them."""
    from sqlalchemy import event

    from gateway.jobs.base import Owner
    from gateway.jobs.weights import _write_saved
    from gateway.storage.db import AuditRow, CheckpointRow, Database, ModelRow, UsageCountedRow

    db = Database(db_url)
    db.add(ModelRow(model_id="m1", session_id="s1", owner="u", base_model="tiny/base", lora_rank=4, lora_config={}))
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "adapter.bin").write_bytes(b"x" * 123)
    commits: list[int] = []
    event.listen(db.engine, "commit", lambda conn: commits.append(1))

    def save(key: str, path: str = "tinker://s1:train:0/weights/a"):
        row = CheckpointRow(tinker_path=path, model_id="m1", owner="u", checkpoint_type="training", name="a",
                            directory=str(tmp_path / "ckpt"), size_bytes=10, created_at=now())
        _write_saved(db, row, Owner("u", "org"), key, usage.disk_bytes(row.directory))

    def written() -> tuple:
        return (len(db.select(select(CheckpointRow))), len(db.select(select(AuditRow))),
                sorted((r.size_bytes, r.until is None) for r in db.select(select(CheckpointStorageRow))),
                sorted(db.select(select(UsageCountedRow.key))))

    save("m1#4")
    assert len(commits) == 1
    assert written() == (1, 1, [(123, True)], ["checkpoint:m1#4"])
    save("m1#4")                      # the same save run again (re-driven): replaced, not counted again
    assert written() == (1, 2, [(123, False), (123, True)], ["checkpoint:m1#4"])
    monkeypatch.setattr(usage, "add", lambda conn, work: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        save("m1#5", "tinker://s1:train:0/weights/b")
    assert written() == (1, 2, [(123, False), (123, True)], ["checkpoint:m1#4"])
    assert db.get(CheckpointRow, "tinker://s1:train:0/weights/b") is None
