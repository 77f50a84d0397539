"""The trainer's gRPC port, as `tinkerd trainer` serves it (a real process, real gRPC): calls
without the service token or the client certificate are refused, and no request can make the
trainer write outside its state dir."""

from __future__ import annotations

import dataclasses
import datetime
import os
import subprocess
import sys

import grpc
import pytest

from tinkerd.rpc import ServiceAuth, channel
from tinkerd.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc

TOKEN = "s3cret-token-for-tests"


def _pem_pair(key, cert) -> tuple[bytes, bytes]:
    from cryptography.hazmat.primitives import serialization

    return (key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()),
            cert.public_bytes(serialization.Encoding.PEM))


def _certificate(subject: str, key, issuer_key=None, issuer=None, *, ca: bool):
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer or name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(issuer_key or key, hashes.SHA256())


def _make_pki(directory) -> dict[str, str]:
    """A CA and one certificate it signed for 127.0.0.1 (server and client alike), as PEM files."""
    pytest.importorskip("cryptography")
    from cryptography.hazmat.primitives.asymmetric import ec

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_cert = _certificate("tinkerd test CA", ca_key, ca=True)
    cert = _certificate("127.0.0.1", key, ca_key, ca_cert.subject, ca=False)
    key_pem, cert_pem = _pem_pair(key, cert)
    files = {}
    for label, data in (("ca", _pem_pair(ca_key, ca_cert)[1]), ("key", key_pem), ("cert", cert_pem)):
        files[label] = str(directory / f"{label}.pem")
        with open(files[label], "wb") as f:
            f.write(data)
    return files


def _tinkerd(*argv: str, **kwargs) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.Popen([sys.executable, "-m", "launcher.cli", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, **kwargs)


@pytest.fixture(scope="module")
def trainer(tiny_model_dir, tmp_path_factory):
    """`tinkerd trainer` with a service token and mTLS; yields its address, state dir and PKI."""
    root = tmp_path_factory.mktemp("auth")
    pki = _make_pki(root)
    token_file = root / "token"
    token_file.write_text(TOKEN + "\n")
    state = root / "state"
    proc = _tinkerd("trainer", "--base-model", tiny_model_dir, "--listen", "127.0.0.1:0", "--state-dir", str(state),
                    "--service-token-file", str(token_file), "--tls-cert", pki["cert"], "--tls-key", pki["key"],
                    "--tls-ca", pki["ca"])
    port = None
    for line in proc.stdout:
        if line.startswith("READY trainer"):
            port = int(line.split()[2])
            break
    if port is None:
        proc.wait(timeout=30)
        pytest.fail("tinkerd trainer did not start:\n" + proc.stderr.read()[-3000:])
    try:
        yield {"address": f"127.0.0.1:{port}", "state": state, "pki": pki}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _auth(pki, *, token: str = "", client_cert: bool = True) -> ServiceAuth:
    read = lambda p: open(p, "rb").read()  # noqa: E731
    return ServiceAuth(token=token, ca=read(pki["ca"]), cert=read(pki["cert"]) if client_cert else b"",
                       key=read(pki["key"]) if client_cert else b"")


def _stub(trainer, auth: ServiceAuth):
    return trainer_pb2_grpc.TrainerStub(channel(trainer["address"], auth))


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code()


def test_calls_without_credentials_are_refused(trainer):
    health = common_pb2.HealthRequest()
    full = _stub(trainer, _auth(trainer["pki"], token=TOKEN))
    assert full.Health(health, timeout=30).ready
    # Plaintext, or TLS without a client certificate: the handshake fails, nothing is served.
    plain = trainer_pb2_grpc.TrainerStub(channel(trainer["address"], ServiceAuth(token=TOKEN)))
    assert _code(lambda: plain.Health(health, timeout=10)) == grpc.StatusCode.UNAVAILABLE
    no_cert = _stub(trainer, _auth(trainer["pki"], token=TOKEN, client_cert=False))
    assert _code(lambda: no_cert.Health(health, timeout=10)) == grpc.StatusCode.UNAVAILABLE
    # A client certificate, but no token or the wrong one.
    for token in ("", "wrong-" + TOKEN, TOKEN[:-1]):
        stub = _stub(trainer, _auth(trainer["pki"], token=token))
        assert _code(lambda: stub.Health(health, timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
        assert _code(lambda: stub.DeleteModel(trainer_pb2.DeleteModelRequest(model_id="x"), timeout=10)) \
            == grpc.StatusCode.UNAUTHENTICATED


def test_each_service_role_calls_only_its_own_methods(trainer):
    """The trainer takes the secret's derived tokens: the gateway's drives it, a sampler's only reads."""
    sampler = _stub(trainer, dataclasses.replace(_auth(trainer["pki"], token=TOKEN), role="sampler"))
    assert sampler.Health(common_pb2.HealthRequest(), timeout=30).ready
    for call in (lambda: sampler.CreateModel(trainer_pb2.CreateModelRequest(model_id="s:role:0"), timeout=30),
                 lambda: sampler.ForwardBackward(trainer_pb2.ForwardBackwardRequest(model_id="s:role:0", seq_id=1),
                                                 timeout=30),
                 lambda: sampler.SaveState(trainer_pb2.SaveStateRequest(model_id="s:role:0", seq_id=1, kind="weights",
                                                                        name="x"), timeout=30)):
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "the sampler service's token" in e.value.details()
    gateway = _stub(trainer, dataclasses.replace(_auth(trainer["pki"], token=TOKEN), role="gateway"))
    assert not gateway.DeleteModel(trainer_pb2.DeleteModelRequest(model_id="s:role:0"), timeout=30).deleted


def _files(root) -> set[str]:
    return {os.path.join(d, f) for d, _, files in os.walk(root) for f in files}


def test_paths_come_from_ids_only(trainer, tmp_path):
    stub = _stub(trainer, _auth(trainer["pki"], token=TOKEN))
    state = trainer["state"]
    stub.CreateModel(trainer_pb2.CreateModelRequest(model_id="s:train:0", lora_config=common_pb2.LoraConfig(
        rank=2, train_attn=True, train_mlp=True)), timeout=120)
    outside = _files(state.parent) - _files(state)
    for kind, name in (("weights", ".."), ("weights", "../../x"), ("weights", "a/b"), ("weights", ""),
                       ("weights", ".hidden"), ("weights", "a\0b"), ("../..", "x"), ("sampler_weights", "x")):
        request = trainer_pb2.SaveStateRequest(model_id="s:train:0", seq_id=1, kind=kind, name=name)
        assert _code(lambda: stub.SaveState(request, timeout=60)) == grpc.StatusCode.INVALID_ARGUMENT, (kind, name)
    for ref in (trainer_pb2.CheckpointRef(model_id="../../..", kind="weights", name="x"),
                trainer_pb2.CheckpointRef(model_id="s:train:0", kind="..", name="x"),
                trainer_pb2.CheckpointRef(model_id="s:train:0", kind="weights", name="../../../etc")):
        request = trainer_pb2.CreateModelRequest(model_id="s:train:1", load_checkpoint=ref)
        assert _code(lambda: stub.CreateModel(request, timeout=60)) == grpc.StatusCode.INVALID_ARGUMENT, ref
    saved = stub.SaveState(trainer_pb2.SaveStateRequest(model_id="s:train:0", seq_id=2, kind="weights", name="ok",
                                                        with_optimizer=True), timeout=120)
    assert saved.directory == str(state / "checkpoints" / "s_train_0" / "weights" / "ok")
    # A model id made of dots is one harmless directory name, still below checkpoints/.
    stub.CreateModel(trainer_pb2.CreateModelRequest(model_id="..", lora_config=common_pb2.LoraConfig(
        rank=2, train_mlp=True)), timeout=120)
    dots = stub.SaveState(trainer_pb2.SaveStateRequest(model_id="..", seq_id=1, kind="weights", name="w"), timeout=120)
    assert dots.directory == str(state / "checkpoints" / "_." / "weights" / "w")
    unloaded = stub.UnloadModel(trainer_pb2.UnloadModelRequest(model_id=".."), timeout=120)
    assert unloaded.directory == str(state / "models" / "_." / "state")
    assert _files(state.parent) - _files(state) == outside
    loaded = stub.CreateModel(trainer_pb2.CreateModelRequest(
        model_id="s:train:2", load_optimizer=True,
        load_checkpoint=trainer_pb2.CheckpointRef(model_id="s:train:0", kind="weights", name="ok")), timeout=120)
    assert loaded.lora_config.rank == 2


def test_non_loopback_listen_needs_credentials(tiny_model_dir, tmp_path):
    proc = _tinkerd("trainer", "--base-model", tiny_model_dir, "--listen", "0.0.0.0:0", "--state-dir", str(tmp_path))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "refusing to serve gRPC on 0.0.0.0:0 without authentication" in err
