"""Streams named tensors from one sender (rank 0) to N receivers over a torch.distributed group.

The group is built from its own TCPStore, so it lives beside whatever default group each
process already has (DeepSpeed's on the trainer, vLLM's on the sampler): gloo or NCCL, as
tinkerd/weight_transport.py chose for the link. The gRPC control plane carries the manifest (names, shapes, chunk layout)
and the rendezvous address; this module only moves bytes.

Small tensors are packed into chunks (fewer collectives); a tensor at least one chunk in size
travels alone, as a zero-copy byte view. `layout` needs no data, so the manifest can go out
first; `send_tensors` then packs chunk by chunk while earlier chunks are on the wire. Every
broadcast is posted at once (gloo runs them back to back on its own threads) and waited for
after. Who keeps which group across pushes is the caller's business (trainer_service/weight_push.py).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import threading
from typing import Callable

import torch
import torch.distributed as dist

from tinkerd import dtypes

DEFAULT_CHUNK_BYTES = 64 << 20
GROUP_PREFIX = "tinkerd-weights"


def dtype_name(dtype: torch.dtype) -> str:
    """torch's name of a dtype, the key of tinkerd.dtypes."""
    return str(dtype).removeprefix("torch.")


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    chunk: int
    offset: int

    @property
    def num_bytes(self) -> int:
        return _num_bytes(dtypes.torch_dtype(self.dtype), self.shape)

    def view(self, chunk: torch.Tensor) -> torch.Tensor:
        """This tensor, as a typed view of its bytes in its (uint8) chunk."""
        raw = chunk[self.offset:self.offset + self.num_bytes]
        return raw.view(dtypes.torch_dtype(self.dtype)).view(self.shape)


@dataclasses.dataclass
class Packed:
    specs: list[TensorSpec]
    chunks: list[torch.Tensor]   # flat uint8
    release: Callable[[], None] = lambda: None    # called once nothing reads the chunks any more

    @property
    def chunk_num_bytes(self) -> list[int]:
        return [c.numel() for c in self.chunks]


def layout(entries, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> tuple[list[TensorSpec], list[int]]:
    """Where each (name, dtype, shape) of `entries` goes: its chunk and byte offset, and each
    chunk's size. Tensors in a chunk lie back to back; one of at least `chunk_bytes` gets a
    chunk of its own. Needs no data, so a manifest can go out before anything is copied."""
    specs: list[TensorSpec] = []
    sizes: list[int] = []
    for name, dtype, shape in entries:
        size = _num_bytes(dtype, shape)
        if not sizes or size >= chunk_bytes or sizes[-1] >= chunk_bytes or sizes[-1] + size > chunk_bytes:
            sizes.append(0)
        specs.append(TensorSpec(name, dtype_name(dtype), tuple(shape), len(sizes) - 1, sizes[-1]))
        sizes[-1] += size
    return specs, sizes


def _num_bytes(dtype: torch.dtype, shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * dtype.itemsize


def allocate(chunk_num_bytes: list[int], flat: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Chunk buffers for a layout: views of one flat allocation (`flat` if given)."""
    if flat is None:
        flat = torch.empty(sum(chunk_num_bytes), dtype=torch.uint8)
    return list(flat.split(chunk_num_bytes)) if chunk_num_bytes else []


def touched(num_bytes: int) -> torch.Tensor:
    """A buffer whose pages are already mapped. Touching fresh memory costs more than copying
    into memory already touched (a page fault per 4 KiB, in the guest and the host:
    docs/benchmarks.md#in-the-gateway-and-every-process), so a hot path fills buffers made
    beforehand."""
    return torch.zeros(num_bytes, dtype=torch.uint8)


def in_background(niceness: int = 10) -> None:
    """Lowers the calling thread's CPU priority (Linux nices each thread on its own), for work
    off a weight sync's critical path (a persisted copy, touching the next receive buffer): on
    busy cores it then gives way to the gather, send and commit of the next sync."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
    except (AttributeError, OSError):
        pass


class BufferPool:
    """Flat buffers kept for reuse by size (see `touched`); at most `keep` idle ones."""

    def __init__(self, keep: int = 2):
        self.keep = keep
        self._idle: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, num_bytes: int) -> torch.Tensor:
        with self._lock:
            for i, buf in enumerate(self._idle):
                if buf.numel() == num_bytes:
                    return self._idle.pop(i)
        return torch.empty(num_bytes, dtype=torch.uint8)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._idle.append(buf)
            del self._idle[:-self.keep]


def pack(tensors: dict[str, torch.Tensor], chunk_bytes: int = DEFAULT_CHUNK_BYTES,
         dtype: torch.dtype | None = None) -> Packed:
    """Lays tensors out in uint8 chunks (cast to `dtype` if given); returns the layout and the
    chunk buffers. A tensor alone in its chunk and already in its dtype travels as a zero-copy
    byte view; the others are copied into one allocation."""
    specs, sizes = layout(((n, dtype or t.dtype, t.shape) for n, t in tensors.items()), chunk_bytes)
    members: list[list[TensorSpec]] = [[] for _ in sizes]
    for s in specs:
        members[s.chunk].append(s)
    alone = {i: tensors[m[0].name] for i, m in enumerate(members)
             if len(m) == 1 and tensors[m[0].name].dtype == dtypes.torch_dtype(m[0].dtype)}
    copied = allocate([0 if i in alone else n for i, n in enumerate(sizes)])
    chunks = [_bytes_of(alone[i]) if i in alone else copied[i] for i in range(len(sizes))]
    for s in specs:
        if s.chunk not in alone:
            s.view(chunks[s.chunk]).copy_(tensors[s.name].detach())
    return Packed(specs, chunks)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def unpack(specs: list[TensorSpec], chunks: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    return {s.name: s.view(chunks[s.chunk]) for s in specs}


@dataclasses.dataclass
class Group:
    """A side process group plus the store that must outlive it."""
    pg: dist.ProcessGroup
    store: dist.Store
    device: torch.device


def _listening_socket(host: str, port: int) -> tuple[int, int]:
    """A socket listening on `host` only: its descriptor (which the store takes over) and port."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    return sock.detach(), port    # the store closes the descriptor when it goes


def local_address_to(host: str) -> str:
    """This host's address on the interface its route to `host` leaves by: where a receiver's
    gloo connections must listen for the sender to reach them. (Left to itself gloo binds to the
    address this host's name resolves to, and to loopback where it resolves to nothing: wrong for
    a sender on another host either way.) The kernel's choice of source address; nothing is sent."""
    family, _, _, _, address = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return probe.getsockname()[0]


def create_store(host: str, port: int, world_size: int, *, is_master: bool,
                 timeout_s: float) -> dist.TCPStore:
    """The rank-0 side listens on `host` (port 0 picks a free one; read `.port`); receivers
    connect. Left to itself a master TCPStore listens on every interface whatever `host` says,
    so the master gets a socket already bound to `host`."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if not is_master:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    fd, port = _listening_socket(host, port)
    return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=fd)


def join_group(store: dist.Store, rank: int, world_size: int, backend: str, timeout_s: float,
               group_name: str, bind_host: str | None = None) -> Group:
    """Blocks until all `world_size` ranks have joined under `group_name`. With `bind_host`,
    gloo's own connections listen on that interface only."""
    prefixed = dist.PrefixStore(f"{GROUP_PREFIX}/{group_name}", store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host) if bind_host
                            else dist.ProcessGroupGloo.create_default_device()]
        return Group(dist.ProcessGroupGloo(prefixed, rank, world_size, options), store, torch.device("cpu"))
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        device = torch.device("cuda", torch.cuda.current_device())
        return Group(dist.ProcessGroupNCCL(prefixed, rank, world_size, options), store, device)
    raise ValueError(f"unknown weight-stream backend {backend!r} (expected gloo or nccl)")


def send(group: Group, chunks: list[torch.Tensor]) -> None:
    """Broadcasts the chunks from rank 0: all posted at once (gloo runs them back to back on its
    own threads), then waited for."""
    works = [group.pg.broadcast(chunk.to(group.device, non_blocking=True), 0) for chunk in chunks]
    for work in works:
        work.wait()


def send_tensors(group: Group, tensors: dict[str, torch.Tensor], specs: list[TensorSpec],
                 chunk_num_bytes: list[int], staging: int = 2) -> None:
    """Streams `tensors` in the layout of `specs` (see `layout`) without packing them all first:
    a chunk that is one tensor in its dtype goes out as it is; the others are packed into one of
    `staging` rotating buffers while the previous chunks are on the wire, so the copy overlaps
    the send instead of preceding it."""
    members: list[list[TensorSpec]] = [[] for _ in chunk_num_bytes]
    for s in specs:
        members[s.chunk].append(s)
    # chunk index -> its staging buffer, for the chunks that are packed
    packed = {i: n % staging for n, i in enumerate(i for i, m in enumerate(members) if not _travels_alone(tensors, m))}
    size = max((chunk_num_bytes[i] for i in packed), default=0)
    buffers = [torch.empty(size, dtype=torch.uint8) for _ in range(min(staging, len(packed)))]
    last_use: list = [None] * len(buffers)       # the broadcast that last sent from each buffer
    works = []
    for i, chunk_members in enumerate(members):
        if i in packed:
            b = packed[i]
            if last_use[b] is not None:
                last_use[b].wait()
            chunk = buffers[b][:chunk_num_bytes[i]]
            for s in chunk_members:
                s.view(chunk).copy_(tensors[s.name].detach())
        else:
            chunk = _bytes_of(tensors[chunk_members[0].name])
        works.append(group.pg.broadcast(chunk.to(group.device, non_blocking=True), 0))
        if i in packed:
            last_use[b] = works[-1]
    for work in works:
        work.wait()


def _travels_alone(tensors: dict[str, torch.Tensor], members: list[TensorSpec]) -> bool:
    return len(members) == 1 and tensors[members[0].name].dtype == dtypes.torch_dtype(members[0].dtype)


def receive(group: Group, chunk_num_bytes: list[int], into: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The chunks rank 0 broadcasts, into one allocation (`into` if given: a CPU buffer of the
    total size); every receive is posted up front."""
    chunks = allocate(chunk_num_bytes, into)
    if group.device.type != "cpu":
        chunks = [c.to(group.device) for c in chunks]
    works = [group.pg.broadcast(chunk, 0) for chunk in chunks]
    for work in works:
        work.wait()
    return chunks if group.device.type == "cpu" else [c.cpu() for c in chunks]


def signal(group: Group, rank: int, value: int) -> int:
    """A one-number message from `rank` to the others (every rank calls it; returns the number):
    the sampler's "ready" or "refused" before the trainer sends anything."""
    flag = torch.tensor([value], dtype=torch.int64, device=group.device)
    group.pg.broadcast(flag, rank).wait()
    return int(flag.item())


def write_safetensors(path, packed: Packed) -> None:
    """Writes packed tensors as a .safetensors file straight from the chunk buffers: a JSON header
    and the chunks as they are (tensors in a chunk are contiguous, so the layout is already
    safetensors'). One large write per chunk, which releases the GIL: cheap to run in a thread
    next to a busy server, unlike serialising tensor by tensor. `path` may also be an open binary
    file (trainer_service/checkpoints.py encrypts an export in memory)."""
    import contextlib
    import json

    starts, position = [], 0
    for n in packed.chunk_num_bytes:
        starts.append(position)
        position += n
    header = {s.name: {"dtype": dtypes.by_name(s.dtype).safetensors, "shape": list(s.shape),
                       "data_offsets": [starts[s.chunk] + s.offset, starts[s.chunk] + s.offset + s.num_bytes]}
              for s in packed.specs}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)          # the format pads the header to 8 bytes
    with open(path, "wb") if isinstance(path, str) else contextlib.nullcontext(path) as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for chunk in packed.chunks:
            f.write(memoryview(chunk.cpu().numpy()))
