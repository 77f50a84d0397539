"""Checkpoints past their ttl are deleted by the gateway's housekeeping: rows and files."""

import datetime

from sqlalchemy import select

from gateway.checkpoints import delete_expired_checkpoints
from gateway.storage.db import CheckpointRow, Database, now


def test_expired_checkpoints_go_others_stay(tmp_path):
    db = Database(f"sqlite:///{tmp_path}/t.db")
    files = tmp_path / "old"
    files.mkdir()
    (files / "adapter_model.safetensors").write_bytes(b"x")
    for name, expires_at in [("old", now() - datetime.timedelta(seconds=5)),
                             ("later", now() + datetime.timedelta(hours=1)), ("never", None)]:
        db.add(CheckpointRow(tinker_path=f"tinker://r:train:0/weights/{name}", model_id="r:train:0",
                             checkpoint_type="training", name=name, expires_at=expires_at,
                             directory=str(files) if name == "old" else ""))
    assert delete_expired_checkpoints(db) == 1
    assert sorted(r.name for r in db.select(select(CheckpointRow))) == ["later", "never"]
    assert not files.exists()
