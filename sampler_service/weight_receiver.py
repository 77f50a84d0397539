"""The sampler's end of the weight stream: one link per trainer, kept across pushes.

The manifest names the transport the trainer chose for this replica (tinkerd/weight_transport.py).
Over a group ("gloo", "nccl"): the trainer names the group in each manifest and says when it is new (`join`): then this
replica forms it with the trainer, replacing any older group from that trainer. A manifest
naming a group this replica does not hold (it restarted since) is refused with ABORTED before
anything moves, and the trainer forms a new group. Before the bytes move the receiver answers
"ready" or "refused" over the group, so a push this replica refuses (say, a snapshot id it
already has) fails at once on both ends and leaves the group usable. A transfer that fails part
way drops the group: what is left on its connections must never be read as the next snapshot.

Through shared memory ("shm", "cuda_ipc"; tinkerd/shared_weights.py) the bytes are already in
place when the manifest arrives: the receiver copies them into its own buffer before replying
(the trainer refills that memory on its next push), so the reply is the whole handshake. It
keeps its mapping of each trainer's /dev/shm file (the trainer removes the name once mapped):
a manifest naming a file it does not hold is ABORTED, as for a group. Memory it cannot open
(another /dev/shm or IPC namespace, another user) is refused with the reason
(TransportRefused), and the trainer takes the next transport.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import threading
from typing import Callable

import grpc
import torch

from tinkerd import shared_weights, weight_stream, weight_transport
from tinkerd.weight_transport import CUDA_IPC, SHM, TransportRefused
from tinkerd.errors import ServiceError
from tinkerd.v1 import sampler_pb2

log = logging.getLogger(__name__)

READY, REFUSED = 1, 0
KEPT_REGIONS = 4     # trainers whose /dev/shm mapping is kept (a restarted trainer is a new one)


class StaleWeightGroup(ServiceError):
    """The manifest names a side group this replica does not hold; the trainer forms a new one."""
    code = grpc.StatusCode.ABORTED


@dataclasses.dataclass
class _Link:
    name: str
    group: weight_stream.Group
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


class WeightReceiver:
    def __init__(self):
        self._links: dict[tuple[str, int], _Link] = {}     # (trainer store host, port) -> its group
        self._lock = threading.Lock()
        self._spare: torch.Tensor | None = None     # see _spare_for
        # trainer id -> (its /dev/shm file, our mapping of it); the oldest goes first
        self._regions: collections.OrderedDict[str, tuple[str, torch.Tensor]] = collections.OrderedDict()

    def receive(self, manifest: sampler_pb2.WeightManifest,
                layout: Callable[[], list[weight_stream.TensorSpec]]) -> dict[str, torch.Tensor]:
        """The manifest's tensors, received the way it names. `layout` (the manifest's,
        checked) runs before anything moves; an error from it refuses the push."""
        if manifest.transport in (SHM, CUDA_IPC):
            return self._receive_shared(manifest, layout)
        return self._receive_grouped(manifest, layout)

    @functools.cached_property
    def endpoint(self) -> weight_transport.Endpoint:
        """This replica's end (its Health says it), found on first use: after the engine is up."""
        return weight_transport.local_endpoint()

    def _receive_grouped(self, manifest: sampler_pb2.WeightManifest,
                         layout: Callable[[], list[weight_stream.TensorSpec]]) -> dict[str, torch.Tensor]:
        """Over the side group the manifest names; a refusal is signalled over the group too
        (the trainer hears "refused")."""
        link = self._link(manifest.rendezvous)
        with link.lock:
            try:
                specs = layout()
            except BaseException:
                weight_stream.signal(link.group, 1, REFUSED)
                raise
            try:
                weight_stream.signal(link.group, 1, READY)
                chunks = weight_stream.receive(link.group, list(manifest.chunk_num_bytes), self._spare_for(manifest))
            except BaseException:
                self._drop(manifest.rendezvous, link)
                raise
        self._touch_spare(sum(manifest.chunk_num_bytes))
        return weight_stream.unpack(specs, chunks)

    def _receive_shared(self, manifest: sampler_pb2.WeightManifest,
                        layout: Callable[[], list[weight_stream.TensorSpec]]) -> dict[str, torch.Tensor]:
        """Copied out of the memory the trainer filled, into a buffer of our own (the trainer
        reuses its memory once we reply, and vLLM keeps views of what it gets)."""
        specs = layout()
        num_bytes = sum(manifest.chunk_num_bytes)
        source = self._region(manifest, num_bytes) if manifest.transport == SHM else self._cuda_source(manifest)
        into = self._spare_for(manifest)
        if into is None:
            into = torch.empty(num_bytes, dtype=torch.uint8)
        into.copy_(source[:num_bytes])
        del source              # a CUDA handle closes with the last reference to what it opened
        self._touch_spare(num_bytes)
        return weight_stream.unpack(specs, weight_stream.allocate(list(manifest.chunk_num_bytes), into))

    def _region(self, manifest: sampler_pb2.WeightManifest, num_bytes: int) -> torch.Tensor:
        """The trainer's /dev/shm file: mapped now if new (`join`), else the mapping kept."""
        shared = manifest.shared
        if shared.join:
            try:
                region = shared_weights.map_region(shared.path, num_bytes)
            except (OSError, ValueError) as e:
                raise TransportRefused(SHM, f"cannot map {shared.path} ({e}); the trainer's /dev/shm is not "
                                            f"this replica's (another container?) or its user is not ours") from e
            with self._lock:
                self._regions.pop(shared.sender, None)
                self._regions[shared.sender] = (shared.path, region)
                while len(self._regions) > KEPT_REGIONS:
                    self._regions.popitem(last=False)
            log.info("weight region %s from trainer %s mapped", shared.path, shared.sender)
            return region
        with self._lock:
            path, region = self._regions.get(shared.sender, ("", None))
        if path != shared.path or region.numel() < num_bytes:
            raise StaleWeightGroup(f"weight region {shared.path!r} is not mapped here (this sampler restarted "
                                   f"since, or let it go)")
        return region

    def _cuda_source(self, manifest: sampler_pb2.WeightManifest) -> torch.Tensor:
        """The trainer's CUDA buffer, opened through its IPC handle on our index of its device."""
        device = manifest.sender.device
        try:
            return shared_weights.open_cuda_handle(manifest.shared.cuda_handle, weight_transport.cuda_index(device))
        except Exception as e:  # noqa: BLE001 - whatever stops it, the trainer takes another transport
            raise TransportRefused(CUDA_IPC, f"cannot open the trainer's CUDA buffer on {device}: "
                                             f"{type(e).__name__}: {e}") from e

    def _spare_for(self, manifest: sampler_pb2.WeightManifest) -> torch.Tensor | None:
        """The buffer touched after the last receive, if this snapshot has its size (the next
        snapshot of an adapter does): receiving into fresh memory costs a page fault per 4 KiB
        on the critical path (weight_stream.touched)."""
        with self._lock:
            spare, self._spare = self._spare, None
        return spare if spare is not None and spare.numel() == sum(manifest.chunk_num_bytes) else None

    def _touch_spare(self, num_bytes: int) -> None:
        """Touches the next snapshot's buffer in the background, between pushes. The received
        snapshot keeps its buffer (vLLM holds views of it), so each receive needs a new one."""
        def touch():
            weight_stream.in_background()
            spare = weight_stream.touched(num_bytes)
            with self._lock:
                self._spare = spare
        threading.Thread(target=touch, name="touch-spare", daemon=True).start()

    def _link(self, rv: sampler_pb2.Rendezvous) -> _Link:
        key = (rv.host, rv.port)
        if not rv.join:
            with self._lock:
                link = self._links.get(key)
            if link is None or link.name != rv.group:
                raise StaleWeightGroup(f"weight group {rv.group!r} from {rv.host}:{rv.port} is not held here "
                                       f"(this sampler restarted since, or dropped it after a failed transfer)")
            return link
        with self._lock:
            self._links.pop(key, None)          # the trainer has given the old one up
        store = weight_stream.create_store(rv.host, rv.port, rv.world_size, is_master=False,
                                           timeout_s=rv.timeout_seconds)
        bind = weight_stream.local_address_to(rv.host)
        group = weight_stream.join_group(store, rv.rank, rv.world_size, rv.backend, rv.timeout_seconds, rv.group,
                                         bind_host=bind)
        link = _Link(rv.group, group)
        with self._lock:
            self._links[key] = link
        log.info("weight group %s with %s:%d formed (%s, this end on %s)", rv.group, rv.host, rv.port, rv.backend,
                 bind)
        return link

    def _drop(self, rv: sampler_pb2.Rendezvous, link: _Link) -> None:
        with self._lock:
            if self._links.get((rv.host, rv.port)) is link:
                del self._links[(rv.host, rv.port)]
        log.warning("weight group %s dropped after a failed transfer", link.name)
