"""Ephemeral sampler snapshots nobody can reach any more are pruned (gateway/housekeeping.py
prune_snapshots): files and sampling sessions go once none of the sampling sessions sampled for
--snapshot-retention-s and each of their sessions is closed or stopped heart-beating. Recently used
ones, ones whose session is live, and named sampler checkpoints stay; in a live session, a model's
snapshots older than its newest go once unused for --superseded-snapshot-retention-s. Timestamps are set in the
database instead of waiting."""

import datetime
import os

from gateway_fakes import assert_user_error, gateway  # noqa: F401 - the fixture

from gateway import housekeeping
from gateway.storage.db import CheckpointRow, SamplingSessionRow, SessionRow, now

_PROMPT = {"chunks": [{"type": "encoded_text", "tokens": [3, 4]}]}


def _ephemeral(api, model_id: str, seq_id: int, n: int) -> str:
    future = api.post("save_weights_for_sampler", {"model_id": model_id, "seq_id": seq_id,
                                                   "sampling_session_seq_id": n}).json()
    return api.result(future).json()["sampling_session_id"]


def _with_files(path: str) -> str:
    """What the trainer's persisted copy leaves there (the fake trainer writes nothing)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        f.write("{}")
    return path


def _sample(api, sid: str, seq_id: int = 0):
    return api.post("asample", {"sampling_session_id": sid, "seq_id": seq_id, "prompt": _PROMPT,
                                "sampling_params": {"max_tokens": 2}})


def test_unreachable_ephemeral_snapshots_are_pruned_and_nothing_else(gateway, tmp_path):
    api, gw = gateway.api, gateway.api.client.app.state.gateway
    db = gw.db
    lapsed, live = api.session(), api.session()
    lapsed_model, live_model = api.model(lapsed), api.model(live)
    old = _ephemeral(api, lapsed_model, 1, 0)          # unused, session lapsed: pruned
    recent = _ephemeral(api, lapsed_model, 2, 1)       # sampled lately: kept
    of_live = _ephemeral(api, live_model, 1, 0)        # its session heart-beats: kept
    named = api.result(api.post("save_weights_for_sampler", {"model_id": lapsed_model, "seq_id": 3,
                                                             "path": "keep"}).json()).json()["path"]
    over_named = api.post("create_sampling_session", {"session_id": lapsed, "sampling_session_seq_id": 7,
                                                      "model_path": named}).json()["sampling_session_id"]
    files = {sid: _with_files(db.get(SamplingSessionRow, sid).snapshot_path)
             for sid in (old, recent, of_live, over_named)}
    assert all(f.startswith(os.path.join(gateway.settings.state_dir, "snapshots")) for f in files.values())
    named_dir = db.get(CheckpointRow, named).directory
    assert named_dir == files[over_named]

    # Everything made two hours ago; `recent` sampled just now (asample records it); the
    # lapsed session's last heartbeat two hours ago.
    two_hours_ago = now() - datetime.timedelta(hours=2)
    for sid in files:
        db.touch(SamplingSessionRow, sid, created_at=two_hours_ago)
    db.touch(SessionRow, lapsed, last_heartbeat=two_hours_ago)
    gateway.settings.snapshot_retention_s = 3600
    assert db.get(SamplingSessionRow, recent).last_used is None
    assert api.result(_sample(api, recent).json()).status_code == 200
    used = db.get(SamplingSessionRow, recent).last_used
    assert used is not None
    assert api.result(_sample(api, recent, 1).json()).status_code == 200
    assert db.get(SamplingSessionRow, recent).last_used == used       # at most one write a minute

    assert housekeeping.prune_snapshots(gw) == 1
    assert not os.path.exists(files[old]) and db.get(SamplingSessionRow, old) is None
    assert all(os.path.isdir(files[sid]) for sid in (recent, of_live, over_named))
    for response in (_sample(api, old), api.get(f"samplers/{old}")):
        assert_user_error(response, 404, "expired", "save_weights_and_get_sampling_client")
    assert housekeeping.prune_snapshots(gw) == 0       # idempotent

    # The live session closes and `recent` goes unused: both go now, `recent` with its files
    # already gone (deleting nothing is fine). The named checkpoint's files and sampling session stay.
    db.touch(SessionRow, live, finished=True)
    db.touch(SamplingSessionRow, recent, last_used=two_hours_ago)
    os.rename(files[recent], str(tmp_path / "moved-away"))
    assert housekeeping.prune_snapshots(gw) == 2
    assert not os.path.exists(files[of_live]) and db.get(SamplingSessionRow, recent) is None
    assert os.path.isdir(named_dir) and db.get(SamplingSessionRow, over_named) is not None
    assert db.get(CheckpointRow, named) is not None
    assert os.path.isdir(tmp_path / "moved-away")


def test_a_live_rl_loop_keeps_its_newest_snapshots_not_every_steps(gateway):
    """One session heart-beats for days while its loop makes a snapshot per step and samples only
    the newest: a superseded snapshot goes once unused for --superseded-snapshot-retention-s; the
    model's newest, and one sampled lately, stay."""
    api, gw = gateway.api, gateway.api.client.app.state.gateway
    db = gw.db
    session = api.session()
    model, other_model = api.model(session), api.model(session, model_seq_id=1)
    steps = [_ephemeral(api, model, seq, seq) for seq in (1, 2, 3, 4)]
    others = [_ephemeral(api, other_model, 1, 10)]      # another model's newest: its own, kept
    files = {sid: _with_files(db.get(SamplingSessionRow, sid).snapshot_path) for sid in steps + others}
    two_hours_ago = now() - datetime.timedelta(hours=2)
    for sid in files:
        db.touch(SamplingSessionRow, sid, created_at=two_hours_ago)
    assert api.result(_sample(api, steps[1]).json()).status_code == 200     # an older one still sampled
    gateway.settings.superseded_snapshot_retention_s = 3600
    assert housekeeping.prune_snapshots(gw) == 2           # steps 0 and 2
    gone = [sid for sid in files if db.get(SamplingSessionRow, sid) is None]
    assert gone == [steps[0], steps[2]] and not any(os.path.exists(files[sid]) for sid in gone)
    assert all(os.path.isdir(files[sid]) for sid in (steps[1], steps[3], others[0]))
    assert_user_error(_sample(api, steps[0]), 404, "save_weights_and_get_sampling_client")
    db.touch(SamplingSessionRow, steps[1], last_used=two_hours_ago)
    assert housekeeping.prune_snapshots(gw) == 1 and db.get(SamplingSessionRow, steps[1]) is None
    assert housekeeping.prune_snapshots(gw) == 0       # each model's newest waits for its session to end


def test_pruning_never_deletes_outside_snapshots(gateway, tmp_path):
    api, gw = gateway.api, gateway.api.client.app.state.gateway
    db = gw.db
    session = api.session()
    sid = _ephemeral(api, api.model(session), 1, 0)
    outside = _with_files(str(tmp_path / "elsewhere"))
    # A row recording a path outside snapshots/, and the snapshot's own directory a link out of it.
    db.touch(SamplingSessionRow, sid, snapshot_path=outside, created_at=now() - datetime.timedelta(hours=2))
    row = db.get(SamplingSessionRow, sid)
    link = os.path.join(gateway.settings.state_dir, "snapshots", row.snapshot_id.replace(":", "_"))
    os.makedirs(os.path.dirname(link), exist_ok=True)
    os.symlink(outside, link)
    db.touch(SessionRow, session, finished=True)
    gateway.settings.snapshot_retention_s = 60
    assert housekeeping.prune_snapshots(gw) == 1
    assert os.path.isfile(os.path.join(outside, "adapter_config.json"))
    assert db.get(SamplingSessionRow, sid) is None
