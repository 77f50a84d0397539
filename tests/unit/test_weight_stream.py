"""Tensors survive pack -> broadcast over a side gloo group -> unpack, between two processes;
and so does the overlapped full-weight stream (send_tensors)."""

import multiprocessing as mp

import torch

from tinkerd import weight_stream

TENSORS = {
    "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
    "b": torch.ones(4, dtype=torch.bfloat16),
    "big": torch.randn(300, dtype=torch.float32, generator=torch.Generator().manual_seed(0)),
}


def _receiver(port, specs, sizes, out):
    store = weight_stream.create_store("127.0.0.1", port, 2, is_master=False, timeout_s=30)
    group = weight_stream.join_group(store, 1, 2, "gloo", 30, "t")
    got = weight_stream.unpack(specs, weight_stream.receive(group, sizes))
    out.put({k: v.float().tolist() for k, v in got.items()})


def test_pack_layout_keeps_large_tensors_alone():
    packed = weight_stream.pack(TENSORS, chunk_bytes=1024)
    assert len(packed.chunks) == 2            # a+b together, big (1200 bytes) alone
    assert weight_stream.unpack(packed.specs, packed.chunks)["a"].tolist() == TENSORS["a"].tolist()


def test_stream_between_processes():
    packed = weight_stream.pack(TENSORS, chunk_bytes=1024)
    store = weight_stream.create_store("127.0.0.1", 0, 2, is_master=True, timeout_s=30)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(store.port, packed.specs, packed.chunk_num_bytes, out))
    proc.start()
    group = weight_stream.join_group(store, 0, 2, "gloo", 30, "t")
    weight_stream.send(group, packed.chunks)
    got = out.get(timeout=60)
    proc.join(timeout=30)
    assert {k: v for k, v in got.items()} == {k: v.float().tolist() for k, v in TENSORS.items()}


def test_packed_tensors_write_a_valid_safetensors_file(tmp_path):
    import safetensors.torch

    packed = weight_stream.pack(TENSORS, chunk_bytes=1024)       # two chunks
    path = str(tmp_path / "a.safetensors")
    weight_stream.write_safetensors(path, packed)
    loaded = safetensors.torch.load_file(path)
    assert set(loaded) == set(TENSORS)
    assert all(torch.equal(loaded[k], TENSORS[k]) for k in TENSORS)


def test_the_store_listens_on_the_advertised_host_only():
    """A master TCPStore left to itself listens on every interface; ours only on `host`."""
    import os

    import psutil

    store = weight_stream.create_store("127.0.0.1", 0, 2, is_master=True, timeout_s=5)
    listening = [c.laddr for c in psutil.Process(os.getpid()).net_connections("inet")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == store.port]
    assert listening and all(addr.ip == "127.0.0.1" for addr in listening), listening


def _stream_receiver(port, specs, sizes, out):
    store = weight_stream.create_store("127.0.0.1", port, 2, is_master=False, timeout_s=30)
    group = weight_stream.join_group(store, 1, 2, "gloo", 30, "s")
    got = weight_stream.unpack(specs, weight_stream.receive(group, sizes, torch.empty(sum(sizes), dtype=torch.uint8)))
    out.put({k: (str(v.dtype), v.float().tolist()) for k, v in got.items()})


def test_layout_closes_a_chunk_before_it_overflows_and_gives_large_tensors_their_own():
    entries = [("a", torch.float32, (100,)), ("big", torch.float32, (300,)), ("b", torch.float32, (100,)),
               ("c", torch.float32, (200,))]
    specs, sizes = weight_stream.layout(entries, chunk_bytes=1024)
    assert [(s.name, s.chunk, s.offset) for s in specs] == [("a", 0, 0), ("big", 1, 0), ("b", 2, 0), ("c", 3, 0)]
    assert sizes == [400, 1200, 400, 800]


def test_send_tensors_overlaps_packing_and_arrives_exact():
    """More packed chunks than staging buffers (each buffer is reused), a chunk travelling alone,
    and a cast to the stream dtype on the way."""
    g = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(40, generator=g) for i in range(12)}
    tensors["alone"] = torch.randn(600, generator=g)
    specs, sizes = weight_stream.layout(((n, torch.bfloat16 if n == "t3" else t.dtype, t.shape)
                                         for n, t in tensors.items()), chunk_bytes=400)
    assert len(sizes) > 4
    store = weight_stream.create_store("127.0.0.1", 0, 2, is_master=True, timeout_s=30)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_stream_receiver, args=(store.port, specs, sizes, out))
    proc.start()
    group = weight_stream.join_group(store, 0, 2, "gloo", 30, "s")
    weight_stream.send_tensors(group, tensors, specs, sizes, staging=2)
    got = out.get(timeout=60)
    proc.join(timeout=30)
    expected = {k: v.to(torch.bfloat16) if k == "t3" else v for k, v in tensors.items()}
    assert got == {k: (str(v.dtype), v.float().tolist()) for k, v in expected.items()}
