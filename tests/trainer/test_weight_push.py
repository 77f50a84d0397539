"""PushWeights' protocol at the servicer: the reply comes only once the persisted copy is
complete, and a copy that cannot be written fails the push."""

import os

import grpc
import pytest
import torch

from tinkerd.v1 import trainer_pb2
from trainer_service.engine import TrainerEngine
from trainer_service.lora import LoraSpec
from trainer_service.servicer import TrainerServicer


class _Aborted(Exception):
    pass


class _Context:
    def abort(self, code, details):
        self.code, self.details = code, details
        raise _Aborted(details)


def test_push_replies_after_the_persisted_copy_is_complete(tiny_model_dir, tmp_path):
    import safetensors.torch

    engine = TrainerEngine(tiny_model_dir, zero_stage=2)
    engine.create_model("s:train:0", LoraSpec(rank=8, seed=0))
    servicer = TrainerServicer(engine, state_dir=str(tmp_path))
    reply = servicer.PushWeights(trainer_pb2.PushWeightsRequest(
        model_id="s:train:0", seq_id=1, snapshot_id="s:train:0@1", persist=True), _Context())
    assert reply.persisted_path == str(tmp_path / "snapshots" / "s_train_0@1")
    assert sorted(os.listdir(tmp_path / "snapshots")) == ["s_train_0@1"]       # no temporary left over
    assert os.path.isfile(os.path.join(reply.persisted_path, "adapter_config.json"))
    loaded = safetensors.torch.load_file(os.path.join(reply.persisted_path, "adapter_model.safetensors"))
    expected, _ = engine.export_adapter("s:train:0")
    assert set(loaded) == set(expected) and all(torch.equal(loaded[k], expected[k]) for k in expected)
    assert reply.num_tensors == len(expected)

    (tmp_path / "snapshots" / "s_train_0@2").write_text("")   # a file in the way: the copy cannot be written
    context = _Context()
    with pytest.raises(_Aborted):
        servicer.PushWeights(trainer_pb2.PushWeightsRequest(
            model_id="s:train:0", seq_id=2, snapshot_id="s:train:0@2", persist=True), context)
    assert context.code == grpc.StatusCode.INTERNAL
