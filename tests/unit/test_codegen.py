"""The committed gRPC stubs are what protoc makes from proto/ today."""

import pathlib

from harness import codegen


def test_generated_stubs_are_current(tmp_path):
    fresh = codegen.generate(tmp_path)
    assert fresh, "protoc generated nothing"
    stale = []
    for path in fresh:
        committed = codegen.REPO_ROOT / path.relative_to(tmp_path)
        if not committed.exists() or committed.read_bytes() != path.read_bytes():
            stale.append(str(committed.relative_to(codegen.REPO_ROOT)))
    assert not stale, f"stale stubs (run `python -m harness.codegen`): {stale}"


def test_stubs_import_as_a_package():
    from tinkerd.v1 import sampler_pb2_grpc, trainer_pb2_grpc
    assert hasattr(trainer_pb2_grpc, "TrainerStub") and hasattr(sampler_pb2_grpc, "SamplerStub")
