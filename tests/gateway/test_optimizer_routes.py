"""A model's optimizer on fake backends: chosen at create_model (AdamW by default, or Dimuon), sent
to the trainer, recorded with the run and reported by get_info and weights_info; optim_step with
the other optimizer's parameters, an unknown optimizer, or a field Dimuon does not have is a 400;
load_weights keeps restored optimizer state's optimizer and an existing model's."""

import time

import pytest

from gateway_fakes import assert_user_error, gateway  # noqa: F401 - the fixture
from tinkerd.v1 import common_pb2

DIMUON = {"type": "dimuon", "version": 1}


def _model(api, session: str, optimizer: dict | None = None, seq: int = 0) -> str:
    body = {"session_id": session, "model_seq_id": seq, "base_model": "tiny/base", "lora_config": {"rank": 8}}
    if optimizer is not None:
        body["optimizer_config"] = optimizer
    return api.result(api.post("create_model", body).json()).json()["model_id"]


def _step(api, model_id: str, seq_id: int, **params):
    return api.post("optim_step", {"model_id": model_id, "seq_id": seq_id, **params})


def test_the_optimizer_is_chosen_at_create_and_reported(gateway):
    api = gateway.api
    session = api.session()
    dimuon, adamw = _model(api, session, DIMUON), _model(api, session, seq=1)
    assert [c.optimizer for c in gateway.trainer.of("CreateModel")] == [common_pb2.OPTIMIZER_DIMUON,
                                                                         common_pb2.OPTIMIZER_ADAMW]
    assert api.post("get_info", {"model_id": dimuon}).json()["optimizer_config"] == DIMUON
    assert api.post("get_info", {"model_id": adamw}).json()["optimizer_config"] == {"type": "adamw"}
    path = api.result(api.post("save_weights", {"model_id": dimuon, "seq_id": 1, "path": "s"}).json()).json()["path"]
    assert api.post("weights_info", {"tinker_path": path}).json()["optimizer_config"] == DIMUON
    copy = api.post("copy_weights", {"source_path": path, "destination_project_id": "p"}).json()["tinker_path"]
    assert api.post("weights_info", {"tinker_path": copy}).json()["optimizer_config"] == DIMUON


@pytest.mark.parametrize("optimizer, words", [
    ({"type": "sgd"}, ["optimizer_config.type", "'adamw' or 'dimuon'"]),
    ({"type": "dimuon", "version": 2}, ["optimizer_config.version"]),
    ({"type": "dimuon", "momentum": 0.5}, ["optimizer_config.momentum"]),
])
def test_an_optimizer_this_server_does_not_have_is_a_400_at_create(gateway, optimizer, words):
    api = gateway.api
    body = {"session_id": api.session(), "base_model": "tiny/base", "optimizer_config": optimizer}
    assert_user_error(api.post("create_model", body), 400, *words)
    assert gateway.trainer.of("CreateModel") == []


def test_optim_step_takes_the_models_own_optimizers_parameters(gateway):
    """DimuonParams reach the trainer as dimuon_params (Tinker's defaults filled in, a nonpositive
    clip norm as none); the other family's parameters are a 400 naming both, in either direction,
    under every key the SDK uses; the refused seq_id takes its turn (SkipSeq)."""
    api = gateway.api
    session = api.session()
    dimuon, adamw = _model(api, session, DIMUON), _model(api, session, seq=1)
    ok = _step(api, dimuon, 1, optimizer_params={"type": "dimuon", "learning_rate": 0.02, "grad_clip_norm": -1.0})
    assert api.result(ok.json()).status_code == 200
    (sent,) = gateway.trainer.of("OptimStep")
    assert not sent.HasField("adam_params") and sent.dimuon_params == common_pb2.DimuonParams(
        learning_rate=0.02, beta1=0.9, damping=1e-4, rank_lr_correction_exponent=0.175, grad_clip_norm=0.0)
    for key in ("adam_params", "optim_params"):
        assert_user_error(_step(api, dimuon, 2, **{key: {"learning_rate": 1e-4}}), 400,
                          f"model {dimuon} was created with the dimuon optimizer; optim_step got AdamParams")
    assert_user_error(_step(api, adamw, 1, optimizer_params={"type": "dimuon", "learning_rate": 0.02}), 400,
                      f"model {adamw} was created with the adamw optimizer; optim_step got DimuonParams")
    deadline = time.monotonic() + 10          # the refusals take their turns in the background
    while len(gateway.trainer.of("SkipSeq")) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted((s.model_id, s.seq_id) for s in gateway.trainer.of("SkipSeq")) == [(dimuon, 2), (adamw, 1)]
    assert len(gateway.trainer.of("OptimStep")) == 1


@pytest.mark.parametrize("params, words", [
    ({"type": "dimuon"}, ["optimizer_params.learning_rate", "required"]),
    ({"type": "dimuon", "learning_rate": 0.1, "weight_decay": 0.1}, ["optimizer_params.weight_decay"]),
    ({"type": "dimuon", "learning_rate": 0.1, "beta1": 1.0}, ["optimizer_params.beta1"]),
    ({"type": "dimuon", "learning_rate": 0.1, "damping": 0.0}, ["optimizer_params.damping"]),
    ({"type": "dimuon", "learning_rate": 2.0}, ["optimizer_params.learning_rate"]),
    ({"type": "dimuon", "learning_rate": 0.1, "rank_lr_correction_exponent": 50}, ["rank_lr_correction_exponent"]),
])
def test_dimuon_parameters_are_checked_at_the_edge(gateway, params, words):
    api = gateway.api
    model_id = _model(api, api.session(), DIMUON)
    assert_user_error(_step(api, model_id, 1, optimizer_params=params), 400, *words)
    assert gateway.trainer.of("OptimStep") == []


def test_load_weights_keeps_the_optimizer_fixed(gateway):
    """With optimizer state the new model is the checkpoint's optimizer's (another one asked for is
    a 400); weights only, it is the one asked for (AdamW by default); an existing model keeps its
    own and takes no other optimizer's state."""
    api = gateway.api
    session = api.session()
    dimuon, adamw = _model(api, session, DIMUON), _model(api, session, seq=1)
    path = api.result(api.post("save_weights", {"model_id": dimuon, "seq_id": 1, "path": "s"}).json()).json()["path"]

    def load(seq: int, **body):
        return api.post("load_weights", {"path": path, "session_id": session, "model_seq_id": seq, **body})

    for seq, body, expected in ((2, {"optimizer": True}, DIMUON), (3, {"optimizer": False}, {"type": "adamw"}),
                                (4, {"optimizer": False, "optimizer_config": DIMUON}, DIMUON)):
        model_id = api.result(load(seq, **body).json()).json()["model_id"]
        assert api.post("get_info", {"model_id": model_id}).json()["optimizer_config"] == expected
    assert [c.optimizer for c in gateway.trainer.of("CreateModel")[2:]] == [common_pb2.OPTIMIZER_DIMUON,
                                                                           common_pb2.OPTIMIZER_ADAMW,
                                                                           common_pb2.OPTIMIZER_DIMUON]
    assert_user_error(load(5, optimizer=True, optimizer_config={"type": "adamw"}), 400,
                      "holds dimuon optimizer state; optimizer_config 'adamw' cannot override it")
    legacy = {"path": path, "model_id": adamw, "seq_id": 1}
    assert_user_error(api.post("load_weights", {**legacy, "optimizer": True}), 400,
                      f"model {adamw} was created with the adamw optimizer", "holds dimuon optimizer state")
    assert_user_error(api.post("load_weights", {**legacy, "seq_id": 2, "optimizer_config": DIMUON}), 400,
                      "cannot change it")
