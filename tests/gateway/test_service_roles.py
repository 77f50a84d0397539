"""Per-service tokens (tinkerd/service_roles.py, tinkerd/rpc.py) over real gRPC and the gateway's
internal listener: services given only their own role's credential file work together (the
gateway trains and samples through them), and a sampler's credential cannot drive the trainer's
writes, a token sent to a sampler opens nothing on the trainer, and only a sampler's token joins
the pool."""

from __future__ import annotations

import json

import grpc
import pytest
from fastapi.testclient import TestClient

from gateway.app import create_app
from gateway.settings import GatewaySettings
from gateway_fakes import Api, FakeSampler, FakeTrainer, assert_user_error, internal_client
from tinkerd import service_roles
from tinkerd.health import ServiceHealth
from tinkerd.rpc import ServiceAuth, ServiceAuthSettings, channel, create_server
from tinkerd.v1 import common_pb2, sampler_pb2, sampler_pb2_grpc, trainer_pb2, trainer_pb2_grpc

SECRET = "one-shared-service-secret-for-tests"


def _credential_file(tmp_path, role: str) -> str:
    path = tmp_path / f"{role}.credential"
    path.write_text(json.dumps(service_roles.credential(SECRET, role)))
    return str(path)


def _auth(tmp_path, role: str) -> ServiceAuth:
    return ServiceAuth.of(ServiceAuthSettings(service_token_file=_credential_file(tmp_path, role)), role)


def _serve(servicer, add, auth: ServiceAuth) -> tuple[grpc.Server, str]:
    server, port = create_server("127.0.0.1:0", max_workers=8, auth=auth)
    add(servicer, server)
    health = ServiceHealth(server)
    server.start()
    health.serving()
    return server, f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """A fake trainer and sampler holding only their credential files, and a gateway holding its own."""
    tmp = tmp_path_factory.mktemp("roles")
    trainer, sampler = FakeTrainer(str(tmp / "state")), FakeSampler()
    trainer_server, trainer_address = _serve(trainer, trainer_pb2_grpc.add_TrainerServicer_to_server,
                                             _auth(tmp, "trainer"))
    sampler_server, sampler_address = _serve(sampler, sampler_pb2_grpc.add_SamplerServicer_to_server,
                                             _auth(tmp, "sampler"))
    settings = GatewaySettings(base_model=str(tmp / "base"), aliases=["tiny/base"], trainer=trainer_address,
                               samplers=[sampler_address], state_dir=str(tmp / "state"),
                               service_token_file=_credential_file(tmp, "gateway"))
    try:
        with TestClient(create_app(settings)) as client:
            yield {"api": Api(client, "").as_user("tester"), "client": client, "tmp": tmp, "trainer": trainer,
                   "sampler": sampler, "trainer_address": trainer_address, "sampler_address": sampler_address}
    finally:
        trainer_server.stop(0)
        sampler_server.stop(0)


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code(), e.value.details()


def test_services_holding_only_their_own_credentials_work_together(stack):
    api = stack["api"]
    model_id = api.model(api.session())
    step = api.post("optim_step", {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 0.1}})
    assert api.result(step.json()).status_code == 200
    body = {"session_id": api.session(), "sampling_session_seq_id": 0, "base_model": "tiny/base"}
    sid = api.post("create_sampling_session", body).json()["sampling_session_id"]
    sample = api.post("asample", {"sampling_session_id": sid, "seq_id": 0, "num_samples": 1,
                                  "prompt": {"chunks": [{"type": "encoded_text", "tokens": [3, 4]}]},
                                  "sampling_params": {"max_tokens": 2}})
    assert api.result(sample.json()).status_code == 200
    assert [r.model_id for r in stack["trainer"].of("CreateModel")] == [model_id]
    assert list(stack["sampler"].requests[-1].prompt_tokens) == [3, 4]
    # A credential file holds its own tokens and digests only: neither the secret nor another role's token.
    text = open(_credential_file(stack["tmp"], "sampler")).read()
    assert SECRET not in text
    for role in ("gateway", "trainer", "operator"):
        for audience in service_roles.AUDIENCES:
            assert service_roles.derive(SECRET, role, audience) not in text


WRITES = [("CreateModel", trainer_pb2.CreateModelRequest(model_id="m")),
          ("DeleteModel", trainer_pb2.DeleteModelRequest(model_id="m")),
          ("ForwardBackward", trainer_pb2.ForwardBackwardRequest(model_id="m", seq_id=1)),
          ("OptimStep", trainer_pb2.OptimStepRequest(model_id="m", seq_id=1)),
          ("PushWeights", trainer_pb2.PushWeightsRequest(model_id="m")),
          ("SaveState", trainer_pb2.SaveStateRequest(model_id="m", kind="weights", name="x")),
          ("UnloadModel", trainer_pb2.UnloadModelRequest(model_id="m")),
          ("SkipSeq", trainer_pb2.SkipSeqRequest(model_id="m", seq_id=1))]


def test_a_samplers_token_cannot_drive_the_trainer(stack):
    sampler_auth = _auth(stack["tmp"], "sampler")
    trainer = trainer_pb2_grpc.TrainerStub(channel(stack["trainer_address"], sampler_auth))
    before = len(stack["trainer"].requests)
    for name, request in WRITES:
        code, details = _code(lambda: getattr(trainer, name)(request, timeout=10))
        assert code == grpc.StatusCode.PERMISSION_DENIED, name
        assert f"the sampler service's token may not call /tinkerd.v1.Trainer/{name}" in details
    assert len(stack["trainer"].requests) == before          # none reached the servicer
    # It may read: the trainer's health and queue.
    assert trainer.Health(common_pb2.HealthRequest(), timeout=10).ready
    trainer.GetQueueState(trainer_pb2.QueueStateRequest(), timeout=10)
    # The gateway's token is let through to the same writes.
    gateway = trainer_pb2_grpc.TrainerStub(channel(stack["trainer_address"], _auth(stack["tmp"], "gateway")))
    assert gateway.DeleteModel(trainer_pb2.DeleteModelRequest(model_id="m"), timeout=10).deleted


def test_a_token_sent_to_a_sampler_opens_nothing_else(stack):
    """What the gateway and the trainer send a replica (perhaps a rogue one) is no key to the trainer."""
    gateway_auth, trainer_auth = _auth(stack["tmp"], "gateway"), _auth(stack["tmp"], "trainer")
    trainer_address = stack["trainer_address"]
    for stolen in (gateway_auth.bearer("sampler"), trainer_auth.bearer("sampler")):
        replayed = ServiceAuth(credential={"role": "stolen", "send": {"trainer": stolen}, "accept": {}})
        stub = trainer_pb2_grpc.TrainerStub(channel(trainer_address, replayed))
        assert _code(lambda: stub.CreateModel(trainer_pb2.CreateModelRequest(model_id="m"), timeout=10))[0] \
            == grpc.StatusCode.UNAUTHENTICATED
    # On the sampler, each caller has its own methods: the gateway samples, the trainer sends weights.
    sampler = sampler_pb2_grpc.SamplerStub(channel(stack["sampler_address"], gateway_auth))
    code, details = _code(lambda: sampler.ReceiveWeights(sampler_pb2.WeightManifest(), timeout=10))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "the gateway service's token" in details
    from_trainer = sampler_pb2_grpc.SamplerStub(channel(stack["sampler_address"], trainer_auth))
    code, details = _code(lambda: from_trainer.Sample(sampler_pb2.SampleRequest(), timeout=10))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "the trainer service's token" in details
    assert from_trainer.Health(common_pb2.HealthRequest(), timeout=10).ready


def test_only_a_samplers_token_joins_the_pool(stack):
    internal = internal_client(stack["client"])
    tmp, register = stack["tmp"], "/internal/v1/samplers/register"
    sampler = {"authorization": f"Bearer {_auth(tmp, 'sampler').bearer('gateway')}"}
    assert internal.post(register, json={"address": "10.0.0.9:5"}, headers=sampler).json() == {"status": "registered"}
    assert internal.post("/internal/v1/samplers/deregister", json={"address": "10.0.0.9:5"},
                         headers=sampler).status_code == 200
    for role in ("trainer", "gateway"):
        headers = {"authorization": f"Bearer {_auth(tmp, role).bearer('gateway')}"}
        assert_user_error(internal.post(register, json={"address": "10.0.0.9:5"}, headers=headers), 403,
                          f"the {role} service's token does not open {register}")
    # A sampler's token for the trainer is not one for the gateway; the sampler's is no admin key.
    wrong = {"authorization": f"Bearer {_auth(tmp, 'sampler').bearer('trainer')}"}
    assert_user_error(internal.post(register, json={"address": "10.0.0.9:5"}, headers=wrong), 403, "service token")
    assert_user_error(internal.get("/internal/futures_stats", headers=sampler), 401, "admin")


def test_a_service_refuses_another_roles_credential_file(tmp_path):
    with pytest.raises(ValueError, match="the sampler service's credential, not the trainer's"):
        ServiceAuth.of(ServiceAuthSettings(service_token_file=_credential_file(tmp_path, "sampler")), "trainer")
