"""PushWeights' protocol at the servicer: for a named checkpoint the reply comes only once the
persisted copy is complete, and a copy that cannot be written fails the push; with
copy_in_background (an ephemeral sampling session) the copy follows the reply, whole, and a
copy that cannot be written leaves its failure marker for readers."""

import os
import time

import grpc
import pytest
import torch

from tinkerd import persisted_copy
from tinkerd.v1 import trainer_pb2
from trainer_service.engine import TrainerEngine
from trainer_service.lora import LoraSpec
from trainer_service.servicer import TrainerServicer

from servicer_context import Aborted, Context, answered


def test_push_replies_after_the_persisted_copy_is_complete(tiny_model_dir, tmp_path):
    import safetensors.torch

    engine = TrainerEngine(tiny_model_dir, zero_stage=2)
    engine.create_model("s:train:0", LoraSpec(rank=8, seed=0))
    servicer = TrainerServicer(engine, state_dir=str(tmp_path))
    reply = servicer.PushWeights(trainer_pb2.PushWeightsRequest(
        model_id="s:train:0", seq_id=1, snapshot_id="s:train:0@1", persist=True), Context())
    assert reply.persisted_path == str(tmp_path / "snapshots" / "s_train_0@1")
    assert sorted(os.listdir(tmp_path / "snapshots")) == ["s_train_0@1"]       # no temporary left over
    assert os.path.isfile(os.path.join(reply.persisted_path, "adapter_config.json"))
    loaded = safetensors.torch.load_file(os.path.join(reply.persisted_path, "adapter_model.safetensors"))
    expected, _ = engine.export_adapter("s:train:0")
    assert set(loaded) == set(expected) and all(torch.equal(loaded[k], expected[k]) for k in expected)
    assert reply.num_tensors == len(expected)

    with torch.no_grad():
        engine.get("s:train:0").params[0].add_(1.0)
    again = servicer.PushWeights(trainer_pb2.PushWeightsRequest(                # a changed adapter, persisted exactly
        model_id="s:train:0", seq_id=3, snapshot_id="s:train:0@3", persist=True), Context())
    loaded = safetensors.torch.load_file(os.path.join(again.persisted_path, "adapter_model.safetensors"))
    expected, _ = engine.export_adapter("s:train:0")
    assert set(loaded) == set(expected) and all(torch.equal(loaded[k], expected[k]) for k in expected)

    (tmp_path / "snapshots" / "s_train_0@2").write_text("")   # a file in the way: the copy cannot be written
    context = Context()
    with pytest.raises(Aborted):
        answered(servicer.PushWeights)(trainer_pb2.PushWeightsRequest(
            model_id="s:train:0", seq_id=2, snapshot_id="s:train:0@2", persist=True), context)
    assert context.code() == grpc.StatusCode.INTERNAL

    # In the background: the push replies with the path, the copy lands there whole.
    with torch.no_grad():
        engine.get("s:train:0").params[0].add_(1.0)
    expected, _ = engine.export_adapter("s:train:0")
    later = servicer.PushWeights(trainer_pb2.PushWeightsRequest(
        model_id="s:train:0", seq_id=4, snapshot_id="s:train:0@4", persist=True, copy_in_background=True), Context())
    assert later.persisted_path == str(tmp_path / "snapshots" / "s_train_0@4")
    persisted_copy.wait_for(later.persisted_path, timeout_s=30)
    loaded = safetensors.torch.load_file(os.path.join(later.persisted_path, "adapter_model.safetensors"))
    assert set(loaded) == set(expected) and all(torch.equal(loaded[k], expected[k]) for k in expected)
    assert servicer.pusher.finish_copies(timeout_s=30)

    # A background copy that cannot be written: the push still succeeded (the samplers hold the
    # snapshot); a reader of the copy learns why at once instead of waiting.
    (tmp_path / "snapshots" / "s_train_0@5").write_text("")
    failed = servicer.PushWeights(trainer_pb2.PushWeightsRequest(
        model_id="s:train:0", seq_id=5, snapshot_id="s:train:0@5", persist=True, copy_in_background=True), Context())
    assert servicer.pusher.finish_copies(timeout_s=30)
    with pytest.raises(persisted_copy.CopyFailedError, match="could not be written"):
        persisted_copy.wait_for(failed.persisted_path, timeout_s=30)
    assert not [n for n in os.listdir(tmp_path / "snapshots") if ".partial-" in n]    # no temporary left over


# ---- the stream to samplers: a kept group per replica, exact bytes, failures that end at once ----

from tinkerd import weight_stream  # noqa: E402
from tinkerd.errors import UserError  # noqa: E402
from tinkerd.rpc import create_server  # noqa: E402
from tinkerd.v1 import common_pb2, sampler_pb2, sampler_pb2_grpc  # noqa: E402
from sampler_service import convert as sampler_convert  # noqa: E402
from sampler_service.weight_receiver import WeightReceiver  # noqa: E402
from trainer_service.weight_push import WeightPusher  # noqa: E402


class _Receiving(sampler_pb2_grpc.SamplerServicer):
    """A sampler replica's receive path (sampler_service/weight_receiver.py, the one the real
    servicer uses) over real gRPC, keeping what arrives instead of handing it to vLLM."""

    def __init__(self):
        self.weights = WeightReceiver()
        self.received: dict[str, dict[str, torch.Tensor]] = {}
        self.joins: list[bool] = []
        self.transports: list[str] = []

    def Health(self, request, context):
        return common_pb2.HealthResponse(ready=True, weight_endpoint=self.weights.endpoint.message())

    def ReceiveWeights(self, request, context):
        self.joins.append(request.rendezvous.join or request.shared.join)
        self.transports.append(request.transport)

        def layout():
            if request.snapshot_id in self.received:
                raise UserError(f"snapshot {request.snapshot_id!r} already exists")
            return sampler_convert.tensor_specs(request)
        got = self.weights.receive(request, layout)
        self.received[request.snapshot_id] = {k: v.clone() for k, v in got.items()}
        return sampler_pb2.SnapshotInfo(snapshot_id=request.snapshot_id)


# The receivers below run in this process, where a CUDA IPC handle of this process cannot be
# opened: their trainer end is on the CPU (shm), also on a GPU host. cuda_ipc is tested across
# two processes (test_two_processes_on_one_gpu_use_cuda_ipc_exactly).
CPU = torch.device("cpu")


def _serve(servicer, port: int = 0):
    server, port = create_server(f"127.0.0.1:{port}")
    sampler_pb2_grpc.add_SamplerServicer_to_server(servicer, server)
    server.start()
    return server, f"127.0.0.1:{port}"


def _push(pusher, addresses, snapshot_id, packed):
    request = trainer_pb2.PushWeightsRequest(model_id="m", snapshot_id=snapshot_id, sampler_addresses=addresses)
    return pusher.push(request, "", packed, {"r": 8}, gather_seconds=0.0)


def _adapter(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.lora_{ab}.weight": torch.randn(8, 16, generator=g) for i in range(3) for ab in "AB"}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_the_sampler_gets_exactly_the_trainers_adapter_over_one_kept_group(tiny_model_dir):
    engine = TrainerEngine(tiny_model_dir, zero_stage=2)
    model = engine.create_model("s:train:0", LoraSpec(rank=8, seed=0))
    sampler = _Receiving()
    server, address = _serve(sampler)
    pusher = WeightPusher("127.0.0.1", transfer_timeout_s=20, device=CPU)
    try:
        for step in range(3):
            with torch.no_grad():
                model.params[step].add_(1.0)      # each snapshot differs from the last
            packed, config = engine.snapshot_adapter("s:train:0")
            expected, _ = engine.export_adapter("s:train:0")
            reply = _push(pusher, [address], f"s@{step}", packed)
            assert _equal(sampler.received[f"s@{step}"], expected)
            assert dict(reply.transports) == {address: "shm"}       # told to the gateway (samplers/list)
        assert sampler.joins == [True, False, False]        # formed once, then kept
        assert sampler.transports == ["shm"] * 3            # one host, on the CPU
    finally:
        server.stop(0)


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_a_restarted_sampler_gets_a_new_group_and_the_push_succeeds(transport):
    first = _Receiving()
    server, address = _serve(first)
    pusher = WeightPusher("127.0.0.1", transfer_timeout_s=20, device=CPU, transports=(transport,))
    _push(pusher, [address], "a", weight_stream.pack(_adapter(0)))
    server.stop(0)
    restarted = _Receiving()                      # same address, none of the old state
    server, _ = _serve(restarted, int(address.rsplit(":", 1)[1]))
    try:
        t0 = time.monotonic()
        _push(pusher, [address], "b", weight_stream.pack(_adapter(1)))
        assert time.monotonic() - t0 < 10         # not the 20 s transfer timeout
        assert restarted.joins == [False, True]   # refused the unknown group, then formed a new one
        assert restarted.transports == [transport, transport]
        assert _equal(restarted.received["b"], _adapter(1))
    finally:
        server.stop(0)


def test_a_refused_push_fails_at_once_and_the_next_one_works():
    sampler = _Receiving()
    server, address = _serve(sampler)
    pusher = WeightPusher("127.0.0.1", transfer_timeout_s=20, device=CPU)
    try:
        _push(pusher, [address], "a", weight_stream.pack(_adapter(0)))
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as refused:
            _push(pusher, [address], "a", weight_stream.pack(_adapter(1)))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "already exists" in refused.value.details()
        assert time.monotonic() - t0 < 5
        _push(pusher, [address], "b", weight_stream.pack(_adapter(2)))
        assert _equal(sampler.received["a"], _adapter(0)) and _equal(sampler.received["b"], _adapter(2))
    finally:
        server.stop(0)


def test_an_unreachable_sampler_fails_the_push_without_waiting_out_the_timeout():
    server, address = _serve(_Receiving())
    server.stop(0)                                # nothing listens there any more
    pusher = WeightPusher("127.0.0.1", transfer_timeout_s=30, device=CPU)
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as failed:
        _push(pusher, [address], "a", weight_stream.pack(_adapter(0)))
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - t0 < 10


def test_every_sampler_replica_gets_the_adapter():
    samplers = [_Receiving(), _Receiving()]
    served = [_serve(s) for s in samplers]
    pusher = WeightPusher("127.0.0.1", transfer_timeout_s=20, device=CPU)
    try:
        for i in range(2):
            _push(pusher, [address for _, address in served], f"s@{i}", weight_stream.pack(_adapter(i)))
        for s in samplers:
            assert _equal(s.received["s@0"], _adapter(0)) and _equal(s.received["s@1"], _adapter(1))
            assert s.joins == [True, False]
    finally:
        for server, _ in served:
            server.stop(0)


# ---- the transport to each replica: chosen from both ends, refused ones give way ----

import logging  # noqa: E402
import multiprocessing  # noqa: E402

from tinkerd import shared_weights, weight_transport  # noqa: E402


class _OtherShm(_Receiving):
    """A replica on this host whose /dev/shm is not the trainer's (another container)."""

    def __init__(self, monkeypatch):
        super().__init__()

        def cannot(path, num_bytes):
            raise FileNotFoundError(2, "No such file or directory", path)
        monkeypatch.setattr(shared_weights, "map_region", cannot)


def test_a_replica_that_cannot_map_the_region_gets_gloo_and_the_push_succeeds(monkeypatch, caplog):
    sampler = _OtherShm(monkeypatch)
    server, address = _serve(sampler)
    pusher = WeightPusher("127.0.0.1", transfer_timeout_s=20, device=CPU)
    try:
        with caplog.at_level(logging.INFO, logger="trainer_service.weight_push"):
            for i in range(2):
                _push(pusher, [address], f"s@{i}", weight_stream.pack(_adapter(i)))
        assert sampler.transports == ["shm", "gloo", "gloo"]     # refused once, then the link is kept
        assert _equal(sampler.received["s@0"], _adapter(0)) and _equal(sampler.received["s@1"], _adapter(1))
        fallback = [r.getMessage() for r in caplog.records if r.getMessage().startswith("weight transport to")]
        assert fallback[-1].startswith(f"weight transport to {address}: gloo (same host") and "shm refused" in fallback[-1]
        assert not [n for n in os.listdir(shared_weights.SHM_DIR) if n.startswith(f"{shared_weights.PREFIX}{os.getpid()}-")]
    finally:
        server.stop(0)


def test_a_replica_no_transport_reaches_fails_the_push_at_once_with_the_reason(monkeypatch):
    sampler = _OtherShm(monkeypatch)
    server, address = _serve(sampler)
    try:
        t0 = time.monotonic()
        with pytest.raises(weight_transport.NoTransport) as refused:     # shm refused, nothing else allowed
            _push(WeightPusher("127.0.0.1", transfer_timeout_s=30, device=CPU, transports=("shm",)), [address], "a",
                  weight_stream.pack(_adapter(0)))
        assert address in str(refused.value) and "cpu" in str(refused.value)
        assert "shm: weight transport refused: shm: cannot map" in str(refused.value)
        with pytest.raises(weight_transport.NoTransport, match="cuda_ipc: needs both ends on one CUDA device"):
            _push(WeightPusher("127.0.0.1", transfer_timeout_s=30, device=CPU, transports=("cuda_ipc", "nccl")), [address], "b",
                  weight_stream.pack(_adapter(0)))
        assert time.monotonic() - t0 < 10
        assert sampler.transports == ["shm"]      # the second never sent anything
    finally:
        server.stop(0)


def _sampler_process(requests, replies):
    """A sampler replica's receive path in a process of its own: serves until told to stop,
    then says what it received."""
    sampler = _Receiving()
    server, address = _serve(sampler)
    replies.put((address, sampler.weights.endpoint))
    expected = requests.get()
    replies.put((sampler.transports, {k: _equal(sampler.received.get(k, {}), _adapter(seed))
                                      for k, seed in expected.items()}))
    server.stop(0)


def _push_to_another_process(pusher, snapshots: dict[str, int], caplog):
    ctx = multiprocessing.get_context("spawn")
    requests, replies = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_sampler_process, args=(requests, replies))
    child.start()
    try:
        address, endpoint = replies.get(timeout=120)
        with caplog.at_level(logging.INFO, logger="trainer_service.weight_push"):
            for snapshot_id, seed in snapshots.items():
                _push(pusher, [address], snapshot_id, weight_stream.pack(_adapter(seed)))
        requests.put(snapshots)
        transports, exact = replies.get(timeout=60)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    chosen = [r.getMessage() for r in caplog.records if r.getMessage().startswith("weight transport to")]
    return address, endpoint, transports, exact, chosen


def test_two_processes_on_one_host_use_shm(caplog):
    pusher = WeightPusher("127.0.0.1", transfer_timeout_s=30, device=CPU)    # the sampler: on its GPU, if any
    address, endpoint, transports, exact, chosen = _push_to_another_process(pusher, {"a": 0, "b": 1}, caplog)
    assert endpoint.host == pusher.endpoint.host
    assert transports == ["shm", "shm"] and exact == {"a": True, "b": True}
    assert chosen == [f"weight transport to {address}: shm (same host {endpoint.host.split('/')[0]}, "
                      f"cpu → {weight_transport.short_device(endpoint.device)})"]


_NO_CUDA = "needs CUDA: trainer and sampler processes sharing one GPU"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason=_NO_CUDA)
def test_two_processes_on_one_gpu_use_cuda_ipc_exactly(caplog):
    pusher = WeightPusher("127.0.0.1", transfer_timeout_s=60)
    address, endpoint, transports, exact, chosen = _push_to_another_process(pusher, {"a": 0, "b": 1, "c": 2}, caplog)
    assert endpoint == pusher.endpoint and endpoint.device.startswith("cuda:")    # the card's UUID on both ends
    assert weight_transport.choose(pusher.endpoint, endpoint) == "cuda_ipc"
    assert transports == ["cuda_ipc"] * 3 and exact == {"a": True, "b": True, "c": True}
    assert len(chosen) == 1 and "cuda_ipc (same host" in chosen[0]
