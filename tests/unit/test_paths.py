"""Paths derived from ids and names only (tinkerd/paths.py): nothing a caller sends can reach
outside the state dir."""

import os

import pytest

from tinkerd import paths
from tinkerd.errors import UserError


@pytest.mark.parametrize("name", ["", ".", "..", "../x", "a/b", "/abs", "a\0b", ".hidden", "sp ace", "x" * 256,
                                  None, 3])
def test_bad_checkpoint_names_are_refused(name):
    with pytest.raises(UserError):
        paths.checked_name(name)


def test_good_names_and_ids_stay_one_component(tmp_path):
    assert paths.checked_name("step-1.final_2") == "step-1.final_2"
    assert paths.dir_name("sess-1:train:0@3-ab") == "sess-1_train_0@3-ab"
    assert [paths.dir_name(i) for i in ("..", ".", "../../etc", ".x")] == ["_.", "_", "_._.._etc", "_x"]
    with pytest.raises(UserError):
        paths.dir_name("")
    state = str(tmp_path)
    assert paths.checkpoint_dir(state, "s:train:0", "weights", "w") == os.path.join(
        state, "checkpoints", "s_train_0", "weights", "w")
    assert paths.snapshot_dir(state, "../x") == os.path.join(state, "snapshots", "_._x")
    assert paths.model_dir(state, "..") == os.path.join(state, "models", "_.")
    with pytest.raises(UserError, match="kind"):
        paths.checkpoint_dir(state, "s:train:0", "..", "w")


def test_symlinks_out_of_the_state_dir_are_refused(tmp_path):
    state, elsewhere = tmp_path / "state", tmp_path / "elsewhere"
    (state / "checkpoints").mkdir(parents=True)
    elsewhere.mkdir()
    (state / "checkpoints" / "run").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(UserError, match="outside"):
        paths.checkpoint_dir(str(state), "run", "weights", "w")


def test_adapter_paths_must_lie_below_snapshots_or_checkpoints(tmp_path):
    state = str(tmp_path / "state")
    snapshot = paths.snapshot_dir(state, "s@1")
    assert paths.adapter_path(state, snapshot) == os.path.realpath(snapshot)
    checkpoint = paths.checkpoint_dir(state, "r", "sampler_weights", "n")
    assert paths.adapter_path(state, checkpoint) == os.path.realpath(checkpoint)
    for path in ("/etc", str(tmp_path), os.path.join(state, "snapshots"), os.path.join(state, "snapshots", "..", ".."),
                 os.path.join(state, "models", "m"), "relative/path"):
        with pytest.raises(UserError):
            paths.adapter_path(state, path)
