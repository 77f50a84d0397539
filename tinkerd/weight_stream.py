"""Streams named tensors from one sender (rank 0) to N receivers over a torch.distributed group.

The group is built from its own TCPStore, so it lives beside whatever default group each
process already has (DeepSpeed's on the trainer, vLLM's on the sampler). gloo on CPU, NCCL when
both ends have a GPU. The gRPC control plane carries the manifest (names, shapes, chunk layout)
and the rendezvous address; this module only moves bytes.

Small tensors are packed into chunks (fewer collectives); a tensor at least one chunk in size
travels alone, as a zero-copy byte view.
"""

from __future__ import annotations

import dataclasses
import datetime
import socket

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
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=dtypes.torch_dtype(self.dtype)).element_size()


@dataclasses.dataclass
class Packed:
    specs: list[TensorSpec]
    chunks: list[torch.Tensor]   # flat uint8

    @property
    def chunk_num_bytes(self) -> list[int]:
        return [c.numel() for c in self.chunks]


def pack(tensors: dict[str, torch.Tensor], chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Packed:
    """Lays tensors out in uint8 chunks; returns the layout and the chunk buffers."""
    specs: list[TensorSpec] = []
    groups: list[list[tuple[str, torch.Tensor]]] = []
    current: list[tuple[str, torch.Tensor]] = []
    current_bytes = 0
    for name, t in tensors.items():
        t = t.detach().contiguous()
        size = t.numel() * t.element_size()
        if size >= chunk_bytes:
            groups.append([(name, t)])
            continue
        if current and current_bytes + size > chunk_bytes:
            groups.append(current)
            current, current_bytes = [], 0
        current.append((name, t))
        current_bytes += size
    if current:
        groups.append(current)

    chunks = []
    for index, members in enumerate(groups):
        views = [t.reshape(-1).view(torch.uint8) for _, t in members]
        chunks.append(views[0] if len(views) == 1 else torch.cat(views))
        offset = 0
        for (name, t), v in zip(members, views):
            specs.append(TensorSpec(name, dtype_name(t.dtype), tuple(t.shape), index, offset))
            offset += v.numel()
    return Packed(specs, chunks)


def unpack(specs: list[TensorSpec], chunks: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for s in specs:
        raw = chunks[s.chunk][s.offset:s.offset + s.num_bytes]
        out[s.name] = raw.view(dtypes.torch_dtype(s.dtype)).reshape(s.shape)
    return out


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


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def send(group: Group, chunks: list[torch.Tensor]) -> None:
    for chunk in chunks:
        buf = chunk.to(group.device, non_blocking=True)
        group.pg.broadcast(buf, 0).wait()


def receive(group: Group, chunk_num_bytes: list[int]) -> list[torch.Tensor]:
    chunks = []
    for n in chunk_num_bytes:
        buf = torch.empty(n, dtype=torch.uint8, device=group.device)
        group.pg.broadcast(buf, 0).wait()
        chunks.append(buf if group.device.type == "cpu" else buf.cpu())
    return chunks


def write_safetensors(path: str, packed: Packed) -> None:
    """Writes packed tensors as a .safetensors file straight from the chunk buffers: a JSON header
    and the chunks as they are (tensors in a chunk are contiguous, so the layout is already
    safetensors'). One large write per chunk, which releases the GIL: cheap to run in a thread
    next to a busy server, unlike serialising tensor by tensor."""
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
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for chunk in packed.chunks:
            f.write(memoryview(chunk.cpu().numpy()))
