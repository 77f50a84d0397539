"""Weights and registry routes on fake backends: named checkpoints, save_state, the registry's
listings, publish/ttl/delete, copies, and the user errors on each."""

import os

from sqlalchemy import select

from gateway_fakes import assert_user_error, gateway  # noqa: F401 - the fixture


def test_save_state_lists_publishes_and_deletes(gateway):
    api = gateway.api
    model_id = api.model(api.session())
    saved = api.result(api.post("save_weights", {"model_id": model_id, "seq_id": 1, "path": "step-1",
                                                 "user_metadata": {"note": "x"}}).json()).json()
    path = saved["path"]
    assert path == f"tinker://{model_id}/weights/step-1"
    (save,) = gateway.trainer.of("SaveState")
    assert save.with_optimizer and (save.kind, save.name) == ("weights", "step-1")
    directory = os.path.join(gateway.settings.state_dir, "checkpoints", model_id.replace(":", "_"), "weights", "step-1")
    assert os.path.isdir(directory)
    ckpts = api.get(f"training_runs/{model_id}/checkpoints").json()["checkpoints"]
    assert [(c["checkpoint_id"], c["size_bytes"], c["user_metadata"]) for c in ckpts] == [("weights/step-1", 10, {"note": "x"})]
    run = api.get(f"training_runs/{model_id}").json()
    assert run["last_checkpoint"]["tinker_path"] == path and run["lora_rank"] == 8
    assert api.post(f"training_runs/{model_id}/checkpoints/weights/step-1/publish").status_code == 200
    assert api.get("checkpoints").json()["checkpoints"][0]["public"] is True
    assert_user_error(api.post("save_weights", {"model_id": model_id, "seq_id": 2, "path": "step-1"}), 400,
                      "already exists")
    assert api.client.delete(f"/api/v1/training_runs/{model_id}/checkpoints/weights/step-1").status_code == 200
    assert not os.path.exists(directory)
    assert_user_error(api.client.delete(f"/api/v1/training_runs/{model_id}/checkpoints/weights/step-1"), 404)


def test_named_sampler_checkpoint_opens_a_sampling_session(gateway):
    api = gateway.api
    session = api.session()
    model_id = api.model(session)
    saved = api.result(api.post("save_weights_for_sampler", {"model_id": model_id, "seq_id": 1,
                                                             "path": "s1"}).json()).json()
    assert saved == {"path": f"tinker://{model_id}/sampler_weights/s1", "sampling_session_id": None,
                     "type": "save_weights_for_sampler"}
    (push,) = gateway.trainer.of("PushWeights")
    assert list(push.sampler_addresses) == gateway.settings.samplers
    sid = api.post("create_sampling_session", {"session_id": session, "model_path": saved["path"]}).json()
    sampler = api.get(f"samplers/{sid['sampling_session_id']}").json()
    assert sampler == {"sampler_id": sid["sampling_session_id"], "base_model": "tiny/base", "model_path": saved["path"]}


def test_ephemeral_snapshot_and_copy(gateway):
    api = gateway.api
    session = api.session()
    model_id = api.model(session)
    eph = api.result(api.post("save_weights_for_sampler", {"model_id": model_id, "seq_id": 1,
                                                           "sampling_session_seq_id": 3}).json()).json()
    assert eph["sampling_session_id"] == f"{session}:sample:3" and eph["path"] is None
    path = api.result(api.post("save_weights", {"model_id": model_id, "seq_id": 2, "path": "c"}).json()).json()["path"]
    headers = {"x-idempotency-key": "k1"}
    copy = api.post("copy_weights", {"source_path": path, "destination_project_id": "p"}, headers=headers).json()
    assert api.post("copy_weights", {"source_path": path, "destination_project_id": "p"}, headers=headers).json() == copy
    info = api.post("weights_info", {"tinker_path": copy["tinker_path"]}).json()
    assert info["lora_rank"] == 8 and info["base_model"] == "tiny/base"


def test_registry_user_errors(gateway):
    api = gateway.api
    assert_user_error(api.get("training_runs", params={"limit": 0}), 400, "limit")
    assert_user_error(api.get("training_runs/nobody:train:0"), 404)
    assert_user_error(api.post("weights_info", {"tinker_path": "file:///etc"}), 400, "tinker://")
    assert_user_error(api.post("copy_weights", {"source_path": "tinker://a:train:0/weights/x"}), 404)
    model_id = api.model(api.session())
    assert_user_error(api.post("save_weights", {"model_id": model_id, "path": "a/b"}), 400, "checkpoint name")
    assert_user_error(api.client.put(f"/api/v1/training_runs/{model_id}/checkpoints/weights/x/ttl",
                                     json={"ttl_seconds": 5}), 404)


def test_a_resent_save_is_answered_with_the_first_ones_future(gateway):
    """The SDK resends a request whose POST timed out or lost its connection with the same seq_id;
    for an ephemeral save_weights_for_sampler it takes the next sampling_session_seq_id on each try
    (tinker 0.38 training_client._send_request), and a named save may have finished meanwhile."""
    api = gateway.api
    session = api.session()
    model_id = api.model(session)
    first = api.post("save_weights_for_sampler", {"model_id": model_id, "seq_id": 1, "sampling_session_seq_id": 0})
    resent = api.post("save_weights_for_sampler", {"model_id": model_id, "seq_id": 1, "sampling_session_seq_id": 1})
    assert resent.status_code == 200 and resent.json() == first.json()
    assert api.result(resent.json()).json()["sampling_session_id"] == f"{session}:sample:0"
    assert len(gateway.trainer.of("PushWeights")) == 1
    for kind, path in (("save_weights_for_sampler", "named"), ("save_weights", "state")):
        body = {"model_id": model_id, "seq_id": 2 if kind == "save_weights" else 3, "path": path}
        done = api.result(api.post(kind, body).json()).json()      # finished: its checkpoint exists now
        again = api.post(kind, body)
        assert again.status_code == 200 and api.result(again.json()).json() == done
        assert_user_error(api.post(kind, {**body, "seq_id": 4}), 400, "already exists")
    assert len(gateway.trainer.of("PushWeights")) == 2 and len(gateway.trainer.of("SaveState")) == 1


def test_a_burst_of_copies_passes_no_checkpoint_quota(gateway):
    """copy_weights makes a checkpoint outside the queue: its bytes are counted in the transaction
    that records it, so 8 copies at once of a 10-byte checkpoint under a 35-byte quota make
    exactly 3 (10 held, then 20, 30; the fourth finds 40), and a refused copy leaves nothing."""
    import concurrent.futures

    from gateway.storage.db import CheckpointRow, ModelRow

    api = gateway.api
    model_id = api.model(api.session())
    path = api.result(api.post("save_weights", {"model_id": model_id, "seq_id": 1, "path": "q"}).json()).json()["path"]
    gateway.api.client.app.state.gateway.settings.max_checkpoint_gb_per_user = 35e-9

    def copy(i: int):
        return api.post("copy_weights", {"source_path": path, "destination_project_id": "p"},
                        headers={"x-idempotency-key": f"burst-{i}"})
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(copy, range(8)))
    made = [r.json()["tinker_path"] for r in answers if r.status_code == 200]
    refused = [r for r in answers if r.status_code != 200]
    assert len(made) == 3, [(r.status_code, r.text[:120]) for r in answers]
    assert all(r.status_code == 400 and "--max-checkpoint-gb-per-user" in r.json()["error"] for r in refused)
    db = gateway.api.client.app.state.gateway.db
    rows = db.select(select(CheckpointRow).where(CheckpointRow.owner == db.get(ModelRow, model_id).owner))
    assert len(rows) == 4          # the source and the three copies: no refused copy's row or run
