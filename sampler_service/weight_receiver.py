"""The sampler's end of the weight stream: one side group per trainer, kept across pushes.

The trainer names the group in each manifest and says when it is new (`join`): then this
replica forms it with the trainer, replacing any older group from that trainer. A manifest
naming a group this replica does not hold (it restarted since) is refused with ABORTED before
anything moves, and the trainer forms a new group. Before the bytes move the receiver answers
"ready" or "refused" over the group, so a push this replica refuses (say, a snapshot id it
already has) fails at once on both ends and leaves the group usable. A transfer that fails part
way drops the group: what is left on its connections must never be read as the next snapshot.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Callable

import grpc
import torch

from tinkerd import weight_stream
from tinkerd.errors import ServiceError
from tinkerd.v1 import sampler_pb2

log = logging.getLogger(__name__)

READY, REFUSED = 1, 0


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

    def receive(self, manifest: sampler_pb2.WeightManifest,
                layout: Callable[[], list[weight_stream.TensorSpec]]) -> dict[str, torch.Tensor]:
        """The manifest's tensors, received over the side group it names. `layout` (the
        manifest's, checked) runs before anything moves; an error from it refuses the push
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
        group = weight_stream.join_group(store, rv.rank, rv.world_size, rv.backend, rv.timeout_seconds, rv.group)
        link = _Link(rv.group, group)
        with self._lock:
            self._links[key] = link
        log.info("weight group %s with %s:%d formed", rv.group, rv.host, rv.port)
        return link

    def _drop(self, rv: sampler_pb2.Rendezvous, link: _Link) -> None:
        with self._lock:
            if self._links.get((rv.host, rv.port)) is link:
                del self._links[(rv.host, rv.port)]
        log.warning("weight group %s dropped after a failed transfer", link.name)
