"""The transport between a trainer and a sampler replica, chosen from their endpoints (host,
device); and the shared-memory mover's region and handle checks."""

import os
import pickle

import pytest
import torch

from tinkerd import shared_weights, weight_transport
from tinkerd.weight_transport import CUDA_IPC, GLOO, NCCL, SHM, Endpoint

A, B = "a/boot-1", "b/boot-2"
GPU0, GPU1 = "cuda:GPU-0000", "cuda:GPU-1111"


@pytest.mark.parametrize("sender, receiver, expected", [
    (Endpoint(A, GPU0), Endpoint(A, GPU0), CUDA_IPC),       # one card shared: NCCL would refuse it
    (Endpoint(A, "cpu"), Endpoint(A, "cpu"), SHM),
    (Endpoint(A, GPU0), Endpoint(A, "cpu"), SHM),           # a host copy either way
    (Endpoint(A, "cpu"), Endpoint(A, GPU0), SHM),
    (Endpoint(A, GPU0), Endpoint(A, GPU1), NCCL),
    (Endpoint(A, GPU0), Endpoint(B, GPU1), NCCL),
    (Endpoint(A, GPU0), Endpoint(B, GPU0), NCCL),           # equal ids on other hosts: not one card
    (Endpoint(A, "cpu"), Endpoint(B, "cpu"), GLOO),
    (Endpoint(A, GPU0), Endpoint(B, "cpu"), GLOO),
    (Endpoint(A, "cpu"), Endpoint(B, GPU0), GLOO),
    (Endpoint(A, "cpu"), Endpoint("", ""), GLOO),           # a replica that did not say
])
def test_the_transport_follows_from_both_endpoints(sender, receiver, expected):
    assert weight_transport.choose(sender, receiver) == expected


def test_a_refused_transport_leaves_the_next_best():
    assert weight_transport.candidates(Endpoint(A, GPU0), Endpoint(A, GPU0)) == [CUDA_IPC, SHM, GLOO]
    assert weight_transport.candidates(Endpoint(A, "cpu"), Endpoint(A, "cpu")) == [SHM, GLOO]
    assert weight_transport.candidates(Endpoint(A, "cpu"), Endpoint(A, "cpu"), allowed=(GLOO,)) == [GLOO]


def test_no_transport_says_which_hosts_and_devices_and_why():
    with pytest.raises(weight_transport.NoTransport) as none:
        weight_transport.choose(Endpoint(A, GPU0), Endpoint(A, GPU0), allowed=(NCCL,))
    message = str(none.value)
    assert "host a (cuda:GPU-0000)" in message and "NCCL refuses two ranks on one device" in message


def test_this_process_has_an_endpoint():
    here = weight_transport.local_endpoint("cpu")
    assert here.device == "cpu" and here.host == weight_transport.host_identity() and "/" in here.host
    assert weight_transport.Endpoint.of(here.message()) == here
    assert weight_transport.explain(SHM, here, here).startswith(f"shm (same host {here.host.split('/')[0]}, cpu → cpu")


def test_a_region_is_private_and_mapped_by_the_receiver_exactly():
    region = shared_weights.Region(1 << 20)
    try:
        assert os.stat(region.path).st_mode & 0o777 == 0o600
        chunks = [torch.arange(100, dtype=torch.uint8), torch.full((7,), 9, dtype=torch.uint8)]
        assert shared_weights.fill(region.buffer, chunks) == 107
        mapped = shared_weights.map_region(region.path, 107)
        region.unlink()                          # the mappings outlive the name
        assert not os.path.exists(region.path)
        assert torch.equal(mapped[:107], torch.cat(chunks))
        region.buffer[0] = 42                    # one memory, seen from both mappings
        assert mapped[0].item() == 42
    finally:
        region.unlink()


def test_a_region_shorter_than_announced_or_elsewhere_is_not_mapped(tmp_path):
    region = shared_weights.Region(4096)
    try:
        with pytest.raises(ValueError, match="fewer than"):
            shared_weights.map_region(region.path, 8192)     # reading past the end would be a SIGBUS
        with pytest.raises(ValueError, match="not a weight region"):
            shared_weights.map_region(str(tmp_path / "x"), 10)
    finally:
        region.unlink()


def test_a_cuda_handle_names_nothing_but_what_a_handle_holds():
    evil = pickle.dumps((os.system, ("true",)))
    with pytest.raises(pickle.UnpicklingError, match="does not name"):
        shared_weights._HandleUnpickler(evil).load()
    # reduce_tensor's arguments for a CUDA tensor name these (the storage class is TypedStorage)
    fine = pickle.dumps((torch.Tensor, torch.Size([4]), (1,), 0, torch.storage.TypedStorage, torch.uint8, 0, b"h"))
    assert shared_weights._HandleUnpickler(fine).load()[5] is torch.uint8


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the endpoint of a real device")
def test_the_real_device_is_named_by_its_uuid_and_one_card_is_cuda_ipc():
    here = weight_transport.local_endpoint()
    assert here.device.startswith("cuda:") and here.device != "cuda:"
    assert weight_transport.cuda_index(here.device) == torch.cuda.current_device()
    assert weight_transport.choose(here, here) == CUDA_IPC
    assert weight_transport.choose(here, Endpoint(here.host, "cpu")) == SHM
