"""A --base-model that is not a model directory is refused at once, saying what a model directory
holds (tinkerd/model_dir.py), by `tinkerd up` before it makes the state dir and by each service
before it loads anything; it was a trainer that "exited with code 1" and a traceback in its log."""

from __future__ import annotations

import json
import os

import pytest
from conftest import run_tinkerd

from tinkerd import model_dir



def _model(path, config: str | None = '{"model_type": "llama"}', weights: str | None = "model.safetensors"):
    path.mkdir()
    if config is not None:
        (path / "config.json").write_text(config)
    if weights:
        (path / weights).write_bytes(b"")
    return str(path)


@pytest.mark.parametrize("make, says", [
    (lambda p: str(p / "missing"), "no such directory"),
    (lambda p: _model(p / "m", config=None), "has no config.json"),
    (lambda p: _model(p / "m", config="{not json"), "config.json is not a JSON object"),
    (lambda p: _model(p / "m", config="[1, 2]"), "config.json is not a JSON object"),
    (lambda p: _model(p / "m", config='{"architectures": ["X"]}'), "names no model_type"),
    (lambda p: _model(p / "m", weights=None), "has no weights"),
], ids=["missing", "no-config", "bad-json", "not-an-object", "no-model-type", "no-weights"])
def test_what_is_not_a_model_dir_is_refused_saying_what_is_missing(tmp_path, make, says):
    path = make(tmp_path)
    with pytest.raises(model_dir.NotAModelDir) as refused:
        model_dir.check(path)
    assert f"--base-model {path}" in str(refused.value) and says in str(refused.value)


@pytest.mark.parametrize("weights", ["model.safetensors", "model-00001-of-00002.safetensors", "pytorch_model.bin"])
def test_a_model_dir_passes(tmp_path, weights):
    model_dir.check(_model(tmp_path / "m", weights=weights))


def test_the_tiny_test_model_passes(tiny_model_dir):
    model_dir.check(tiny_model_dir)
    with open(os.path.join(tiny_model_dir, "config.json")) as f:
        assert json.load(f)["model_type"] == "llama"


@pytest.mark.parametrize("command", ["up", "trainer", "sampler", "gateway"])
def test_each_command_refuses_a_mistyped_base_model_before_it_starts(tmp_path, command):
    state = tmp_path / "state"
    argv = [command, "--base-model", str(tmp_path / "SmolLM2-135m"), "--state-dir", str(state)]
    if command == "gateway":
        argv += ["--trainer", "127.0.0.1:1"]
    r = run_tinkerd(*argv)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert f"--base-model {tmp_path / 'SmolLM2-135m'}: no such directory" in r.stderr, r.stderr
    assert "fetch-smollm2" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not state.exists()
