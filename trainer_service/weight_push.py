"""PushWeights: an adapter snapshot to every sampler replica and to its persisted PEFT copy.

The protocol: the adapter arrives gathered into its send chunks (adapter_snapshot.py); stream
to the samplers (announce over gRPC, broadcast over a side torch.distributed group, wait for
each sampler's commit); write the persisted copy (temporary directory, then rename). When the
copy is written depends on who waits for it:
- `copy_in_background` (an ephemeral sampling session): the reply goes out once every sampler
  has committed, and the copy is written after, in a thread, off the critical path. A reader
  that needs it before then (a replica that missed the push or joins later) waits for the
  rename or for its failure marker (tinkerd/persisted_copy.py), never reads half of it.
- otherwise (a named checkpoint, which the gateway records and lists as files on disk): the copy
  is written beside the stream and the reply waits for both, so its persisted_path always
  holds the whole adapter. Either failing fails the push.

Each sampler replica gets its own link, formed on the first push to it and kept (forming one
costs a rendezvous and new connections on every push otherwise). Its transport is chosen then,
from this end's and the replica's (its Health) host and device (tinkerd/weight_transport.py):
a two-rank side group (gloo, nccl), or memory both map (shm, cuda_ipc: tinkerd/shared_weights.py,
no group); a transport the replica refuses gives way to the next, and the choice is made again
whenever the link is dropped. Pushes to one
replica take turns on it, pushes to several run side by side. The receiver's end and its rules
are in sampler_service/weight_receiver.py: it answers "ready" before the bytes move, a replica
that restarted answers ABORTED and gets a new group, and any failure drops the group on both
ends. Nothing waits without a limit: the gRPC call and the group's operations carry
transfer_timeout_s, and a sampler's error reply ends the push even while its transfer is
still blocked (that thread is left to time out on a group nobody uses again).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import ipaddress
import json
import logging
import socket
import threading
import time
import uuid

import grpc
import torch

from tinkerd import hardware, persisted_copy, shared_weights, weight_stream, weight_transport
from tinkerd.rpc import ServiceAuth, channel
from tinkerd.v1 import common_pb2, sampler_pb2, sampler_pb2_grpc, trainer_pb2
from trainer_service import metrics
from trainer_service.checkpoints import save_peft_adapter
from trainer_service.convert import tensor_specs

log = logging.getLogger(__name__)

READY = 1      # the receiver's answer before the bytes move (sampler_service/weight_receiver.py)


def _start_copy(path: str, packed: weight_stream.Packed, config: dict, *,
                background: bool = False) -> concurrent.futures.Future:
    """save_peft_adapter in its own thread (its large writes release the GIL, so it runs beside
    the stream; `background`: at a lower CPU priority); the future's result is its duration in
    seconds."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def write():
        if background:
            weight_stream.in_background()
        t0 = time.perf_counter()
        try:
            save_peft_adapter(path, packed, config)
        except BaseException as e:  # noqa: BLE001 - handed to the push, which fails with it
            future.set_exception(e)
        else:
            future.set_result(time.perf_counter() - t0)
    threading.Thread(target=write, name="persisted-copy", daemon=True).start()
    return future


def _in_thread(fn, name: str) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run():
        try:
            future.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
            future.set_exception(e)
    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def _refusal(error: BaseException) -> str | None:
    """Why the transport was refused (by the replica, or by this end unable to offer it), or
    None for any other failure."""
    if isinstance(error, weight_transport.TransportRefused):
        return str(error)
    if isinstance(error, grpc.RpcError) and weight_transport.is_refusal(error):
        return error.details()
    return None


@dataclasses.dataclass
class _Link:
    """What is kept for one sampler replica across pushes: the transport chosen to it (None:
    choose when next used) and what that transport holds: the side group (gloo, nccl), the
    /dev/shm region (shm) or the CUDA buffer (cuda_ipc); none of them until formed, and again
    after a failure."""
    transport: str | None = None
    receiver: weight_transport.Endpoint | None = None
    untried: list[str] = dataclasses.field(default_factory=list)      # the next transports, best first
    refused: dict[str, str] = dataclasses.field(default_factory=dict)  # transport -> why it was refused
    group: weight_stream.Group | None = None
    name: str = ""
    region: shared_weights.Region | None = None
    cuda: torch.Tensor | None = None
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @property
    def formed(self) -> bool:
        return self.group is not None or (self.region is not None and not self.region.fresh) or self.cuda is not None

    def shared_region(self, num_bytes: int) -> shared_weights.Region:
        """The link's region, a new one if it is smaller than `num_bytes`."""
        if self.region is None or self.region.buffer.numel() < num_bytes:
            self.release()
            try:
                self.region = shared_weights.Region(num_bytes)
            except OSError as e:
                raise weight_transport.TransportRefused(weight_transport.SHM, f"the trainer cannot create a "
                                                        f"region in {shared_weights.SHM_DIR}: {e}") from e
            self.name = self.region.path
        return self.region

    def cuda_buffer(self, num_bytes: int, device: torch.device) -> torch.Tensor:
        if self.cuda is None or self.cuda.numel() < num_bytes:
            self.cuda = None          # the smaller one freed before the larger is allocated
            self.cuda = torch.empty(num_bytes, dtype=torch.uint8, device=device)
            self.name = f"cuda buffer of {num_bytes} bytes"
        return self.cuda

    def release(self) -> None:
        if self.region is not None:
            self.region.unlink()
        self.group, self.region, self.cuda = None, None, None


@dataclasses.dataclass
class _Timings:
    join: float = 0.0
    handshake: float = 0.0
    send: float = 0.0


class WeightPusher:
    """`transports`: those it may use (tinkerd/weight_transport.py; all by default), e.g. one
    to force it; `device`: where this trainer's weights live (the current CUDA device, if any)."""

    def __init__(self, advertise_host: str, transfer_timeout_s: float, auth: ServiceAuth = ServiceAuth(), *,
                 transports=weight_transport.PREFERENCE, device: torch.device | None = None):
        self.advertise_host = advertise_host
        self.transfer_timeout_s = transfer_timeout_s
        self.auth = auth
        self.transports = tuple(transports)
        self.device = hardware.default_device() if device is None else device
        self.endpoint = weight_transport.local_endpoint(device)
        self.id = uuid.uuid4().hex      # tells this trainer process apart in a replica's kept regions
        self._samplers: dict[str, sampler_pb2_grpc.SamplerStub] = {}
        self._links: dict[str, _Link] = {}
        self._lock = threading.Lock()
        self._store = None      # the rendezvous store every side group forms through; made on first use
        self._copies: set[concurrent.futures.Future] = set()    # background copies not yet written

    def push(self, request: trainer_pb2.PushWeightsRequest, persisted: str, packed: weight_stream.Packed,
             config: dict, *, gather_seconds: float) -> trainer_pb2.PushWeightsResponse:
        """Streams the `packed` adapter as the request asks and, unless `persisted` is empty,
        writes its PEFT copy there; see the module docstring."""
        t0 = time.perf_counter()
        later = bool(persisted) and request.copy_in_background
        copy = _start_copy(persisted, packed, config) if persisted and not later else None
        try:
            transports = self._stream(request, packed, config, persisted) if request.sampler_addresses else {}
            t_streamed = time.perf_counter()
            copy_seconds = copy.result() if copy is not None else 0.0
        except BaseException:
            if copy is not None:
                concurrent.futures.wait([copy])    # no write goes on after the reply, a failed one included
            packed.release()
            raise
        reply = trainer_pb2.PushWeightsResponse(
            snapshot_id=request.snapshot_id, num_bytes=sum(packed.chunk_num_bytes), num_tensors=len(packed.specs),
            gather_seconds=gather_seconds, stream_seconds=t_streamed - t0, persisted_path=persisted,
            transports=transports)
        if later:
            self._copy_later(request.snapshot_id, persisted, packed, config)    # releases `packed` when done
        else:
            packed.release()
        log.info("pushed %s: %d tensors, %d bytes, gather %.1f ms, stream %.1f ms, copy %s", request.snapshot_id,
                 reply.num_tensors, reply.num_bytes, 1e3 * gather_seconds, 1e3 * (t_streamed - t0),
                 "in the background" if later else
                 f"{1e3 * copy_seconds:.1f} ms ({1e3 * (time.perf_counter() - t_streamed):.1f} ms of it after the stream)")
        return reply

    def _copy_later(self, snapshot_id: str, persisted: str, packed: weight_stream.Packed, config: dict) -> None:
        """The persisted copy, written after the reply; a failure is logged and left as the
        copy's failure marker for whoever waits for it."""
        copy = _start_copy(persisted, packed, config, background=True)
        with self._lock:
            self._copies.add(copy)

        def done(future: concurrent.futures.Future) -> None:
            packed.release()
            with self._lock:
                self._copies.discard(future)
            if future.exception() is not None:
                log.error("persisted copy of %s failed: %s", snapshot_id, future.exception())
                persisted_copy.record_failure(persisted, future.exception())
            else:
                log.info("persisted copy of %s written in %.1f ms", snapshot_id, 1e3 * future.result())
        copy.add_done_callback(done)

    def finish_copies(self, timeout_s: float) -> bool:
        """Waits for the background copies still being written (at shutdown); True if none is left."""
        with self._lock:
            copies = list(self._copies)
        return not concurrent.futures.wait(copies, timeout=timeout_s).not_done

    def _stream(self, request, packed: weight_stream.Packed, config: dict, persisted: str) -> dict[str, str]:
        """Pushes to every replica at once; returns {address: transport} of those that took it."""
        manifest = sampler_pb2.WeightManifest(
            snapshot_id=request.snapshot_id, adapter_config_json=json.dumps(config), tensors=tensor_specs(packed),
            chunk_num_bytes=packed.chunk_num_bytes, persisted_path=persisted, model_id=request.model_id)
        addresses = list(dict.fromkeys(request.sampler_addresses))
        with concurrent.futures.ThreadPoolExecutor(len(addresses), thread_name_prefix="push") as pool:
            pushes = [pool.submit(self._push_to, address, manifest, packed) for address in addresses]
        transports = {}
        for address, push in zip(addresses, pushes):
            try:
                transports[address] = push.result()
            except Exception as e:  # noqa: BLE001 - with a persisted copy, one replica's failure is not the push's
                if not persisted:
                    raise
                # A replica that died or restarted mid-push loads the persisted copy on first use.
                log.warning("replica %s did not take %s (%s: %s); it will load the persisted copy when asked",
                            address, request.snapshot_id, type(e).__name__, e)
        return transports

    def _push_to(self, address: str, manifest: sampler_pb2.WeightManifest, packed: weight_stream.Packed) -> str:
        """One replica's share over its link: choose the transport if the link is new, send, wait
        for its commit; returns the transport. A transport the replica refuses gives way to the
        next (the push fails at once when none is left); a replica that answers ABORTED lost the
        link (it restarted): once, form a new one."""
        link = self._link(address)
        with link.lock:
            retried = False
            while True:
                if link.transport is None:
                    self._choose(link, address)
                join = not link.formed
                try:
                    self._send(link, address, manifest, packed, join)
                except BaseException as e:
                    refusal = _refusal(e)
                    self._drop(link, address, e, refused=refusal)
                    if refusal is not None:
                        self._next_transport(link, address)
                        continue
                    if not retried and not join and isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.ABORTED:
                        retried = True      # the replica restarted since the link formed
                        continue
                    raise
                if join:
                    metrics.WEIGHT_LINKS.labels(link.transport).inc()
                return link.transport

    def _send(self, link: _Link, address: str, manifest: sampler_pb2.WeightManifest, packed: weight_stream.Packed,
              join: bool) -> None:
        announced = sampler_pb2.WeightManifest()
        announced.CopyFrom(manifest)
        announced.transport = link.transport
        announced.sender.CopyFrom(self.endpoint.message())
        if link.transport in weight_transport.GROUP_TRANSPORTS:
            self._send_grouped(link, address, announced, packed, join)
        else:
            self._send_shared(link, address, announced, packed)

    def _send_grouped(self, link: _Link, address: str, announced: sampler_pb2.WeightManifest,
                      packed: weight_stream.Packed, join: bool) -> None:
        """Announce, (form the group,) handshake, broadcast, wait for the commit."""
        t0 = time.perf_counter()
        if join:
            link.name = f"{uuid.uuid4().hex[:16]}"
        announced.rendezvous.CopyFrom(sampler_pb2.Rendezvous(
            host=self.advertise_host, port=self.store().port, rank=1, world_size=2, backend=link.transport,
            timeout_seconds=self.transfer_timeout_s, group=link.name, join=join))
        reply = self._sampler(address).ReceiveWeights.future(announced, timeout=self.transfer_timeout_s)
        timings = _Timings()
        self._transfer(link, join, packed, reply, timings)
        t_sent = time.perf_counter()
        reply.result()
        log.info("stream %s to %s: %s, %s %.1f ms, handshake %.1f ms, send %.1f ms, commit %.1f ms (total %.1f)",
                 announced.snapshot_id, address, link.transport, "join" if join else "announce", 1e3 * timings.join,
                 1e3 * timings.handshake, 1e3 * timings.send, 1e3 * (time.perf_counter() - t_sent),
                 1e3 * (time.perf_counter() - t0))

    def _send_shared(self, link: _Link, address: str, announced: sampler_pb2.WeightManifest,
                     packed: weight_stream.Packed) -> None:
        """Fill the link's shared memory, announce where it is, wait for the commit: the replica
        has copied the bytes out by then, so the memory is free for the next push."""
        t0 = time.perf_counter()
        num_bytes = sum(packed.chunk_num_bytes)
        announced.shared.sender = self.id
        if link.transport == weight_transport.SHM:
            region = link.shared_region(num_bytes)
            shared_weights.fill(region.buffer, packed.chunks)
            announced.shared.path, announced.shared.join = region.path, region.fresh
        else:
            buffer = link.cuda_buffer(num_bytes, self.device)
            announced.shared.cuda_handle = shared_weights.cuda_handle(buffer[:shared_weights.fill(buffer, packed.chunks)])
        t_filled = time.perf_counter()
        self._sampler(address).ReceiveWeights(announced, timeout=self.transfer_timeout_s)
        if link.region is not None and link.region.fresh:
            link.region.unlink()        # the replica keeps its mapping; nothing is left behind if we die
            link.region.fresh = False
        log.info("stream %s to %s: %s, fill %.1f ms, commit %.1f ms (total %.1f)", announced.snapshot_id, address,
                 link.transport, 1e3 * (t_filled - t0), 1e3 * (time.perf_counter() - t_filled),
                 1e3 * (time.perf_counter() - t0))

    def _choose(self, link: _Link, address: str) -> None:
        """Asks the replica for its end (its Health) and lines up the transports to it."""
        health = self._sampler(address).Health(common_pb2.HealthRequest(), timeout=self.transfer_timeout_s)
        link.receiver = weight_transport.Endpoint.of(health.weight_endpoint)
        link.untried = weight_transport.candidates(self.endpoint, link.receiver, self.transports)
        link.refused = {}
        if link.receiver.host and link.receiver.host != self.endpoint.host and self._loopback_advertised():
            # The group's store and connections listen on loopback: another host cannot reach them.
            for transport in weight_transport.GROUP_TRANSPORTS:
                if transport in link.untried:
                    link.untried.remove(transport)
                    link.refused[transport] = (f"this trainer's weight streams listen on {self.advertise_host} "
                                               f"(--advertise-host, or --listen's host), loopback, which a "
                                               f"sampler on another host cannot reach")
        self._next_transport(link, address)

    def _loopback_advertised(self) -> bool:
        try:
            return ipaddress.ip_address(socket.gethostbyname(self.advertise_host)).is_loopback
        except OSError:
            return False

    def _next_transport(self, link: _Link, address: str) -> None:
        if not link.untried:
            link.transport = None
            raise weight_transport.NoTransport(f"sampler {address}: " + weight_transport.unreachable(
                self.endpoint, link.receiver, self.transports, link.refused))
        link.transport = link.untried.pop(0)
        log.info("weight transport to %s: %s%s", address, weight_transport.explain(link.transport, self.endpoint,
                 link.receiver), "".join(f"; {t} refused: {why}" for t, why in link.refused.items()))

    def _transfer(self, link: _Link, join: bool, packed: weight_stream.Packed, reply, timings: _Timings) -> None:
        """Forms the group if `join`, waits for the receiver's "ready", sends. Runs in its own
        thread so that the sampler's error reply ends the wait even when the group blocks (a
        receiver that failed before joining, or went away). A receiver that refused sends its
        reason as its reply, which the caller waits for next."""
        group, backend = link.group, link.transport

        def transfer() -> bool:
            nonlocal group
            t0 = time.perf_counter()
            if join:
                group = weight_stream.join_group(self.store(), 0, 2, backend, self.transfer_timeout_s,
                                                 link.name, bind_host=self.advertise_host)
            t_joined = time.perf_counter()
            ready = weight_stream.signal(group, 1, 0) == READY
            t_ready = time.perf_counter()
            if ready:
                weight_stream.send(group, packed.chunks)
            timings.join, timings.handshake = t_joined - t0, t_ready - t_joined
            timings.send = time.perf_counter() - t_ready
            return ready

        sent = _in_thread(transfer, "weight-send")
        wake = threading.Event()
        sent.add_done_callback(lambda _: wake.set())
        reply.add_done_callback(lambda _: wake.set())
        deadline = time.monotonic() + self.transfer_timeout_s + 10
        while True:
            wake.clear()
            if sent.done():
                break
            if reply.done() and reply.exception() is not None:
                raise reply.exception()
            if not wake.wait(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"weight transfer to a sampler did not finish in {self.transfer_timeout_s} s")
        sent.result()
        link.group = group

    def _drop(self, link: _Link, address: str, error: BaseException, refused: str | None = None) -> None:
        """Lets the link go (a failure leaves nothing on it to trust). A refusal keeps the
        transports still untried; anything else chooses again on the next push."""
        if link.formed:
            log.warning("weight link %s to %s (%s) dropped: %s", link.name, address, link.transport, error)
        link.release()
        if refused is not None:
            link.refused[link.transport] = refused
        else:
            link.transport = None

    def close(self) -> None:
        """At shutdown: a /dev/shm file whose name is left (a region no replica has mapped yet)
        is unlinked; a push still using it keeps its mapping."""
        with self._lock:
            regions = [link.region for link in self._links.values() if link.region is not None]
        for region in regions:
            region.unlink()

    def _link(self, address: str) -> _Link:
        with self._lock:
            return self._links.setdefault(address, _Link())

    def store(self):
        with self._lock:
            if self._store is None:
                self._store = weight_stream.create_store(self.advertise_host, 0, 2, is_master=True,
                                                         timeout_s=self.transfer_timeout_s)
            return self._store

    def _sampler(self, address: str):
        """One channel per sampler replica, kept: a new one per push costs a connection setup."""
        stub = self._samplers.get(address)
        if stub is None:
            stub = self._samplers[address] = sampler_pb2_grpc.SamplerStub(channel(address, self.auth))
        return stub
