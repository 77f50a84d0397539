"""A database written by an older tinkerd (fewer columns) opens and works after the upgrade."""

import sqlalchemy

from gateway.storage.db import CheckpointRow, Database, ModelRow, UserRow


def test_an_old_database_gets_the_new_columns(tmp_path):
    url = f"sqlite:///{tmp_path / 'old.db'}"
    engine = sqlalchemy.create_engine(url)
    with engine.begin() as conn:     # the checkpoints and models tables as an early version made them
        conn.execute(sqlalchemy.text(
            "CREATE TABLE checkpoints (tinker_path VARCHAR(768) PRIMARY KEY, model_id VARCHAR(256), "
            "checkpoint_type VARCHAR(16), name VARCHAR(256), created_at DATETIME)"))
        conn.execute(sqlalchemy.text(
            "INSERT INTO checkpoints VALUES ('tinker://r:train:0/weights/a', 'r:train:0', 'training', 'a', NULL)"))
        conn.execute(sqlalchemy.text(
            "CREATE TABLE models (model_id VARCHAR(256) PRIMARY KEY, session_id VARCHAR(128), "
            "base_model VARCHAR(512), lora_rank INTEGER, lora_config JSON)"))
    engine.dispose()

    db = Database(url)
    old = db.get(CheckpointRow, "tinker://r:train:0/weights/a")
    assert old.public is False and old.directory == "" and old.expires_at is None
    db.add(ModelRow(model_id="r:train:1", session_id="r", base_model="m", lora_rank=4, lora_config={}))
    db.add(CheckpointRow(tinker_path="tinker://r:train:1/weights/b", model_id="r:train:1", checkpoint_type="training",
                         name="b", directory="/x", public=True))
    assert db.get(ModelRow, "r:train:1").resident is True
    assert Database(url).get(CheckpointRow, "tinker://r:train:1/weights/b").public is True   # reopened: no-op


def test_rows_from_before_users_become_the_admins(tmp_path):
    """An upgraded database's rows (no owner) belong to the admin user, who got the first key."""
    from gateway.settings import GatewaySettings
    from gateway.state import ADMIN_USER, Gateway

    state = tmp_path / "state"
    state.mkdir(mode=0o700)       # a state dir is private (gateway/storage/state_dir.py)
    url = f"sqlite:///{state / 'tinkerd.db'}"
    engine = sqlalchemy.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sqlalchemy.text(
            "CREATE TABLE checkpoints (tinker_path VARCHAR(768) PRIMARY KEY, model_id VARCHAR(256), "
            "checkpoint_type VARCHAR(16), name VARCHAR(256), created_at DATETIME)"))
        conn.execute(sqlalchemy.text(
            "INSERT INTO checkpoints VALUES ('tinker://r:train:0/weights/a', 'r:train:0', 'training', 'a', NULL)"))
    engine.dispose()
    gw = Gateway.create(GatewaySettings(base_model="m", trainer="t", samplers=[], state_dir=str(state)))
    admin = gw.db.select(sqlalchemy.select(UserRow).where(UserRow.name == ADMIN_USER))[0]
    assert admin.admin and gw.db.get(CheckpointRow, "tinker://r:train:0/weights/a").owner == admin.user_id
