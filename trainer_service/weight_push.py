"""PushWeights: an adapter snapshot to every sampler replica and to its persisted PEFT copy.

The protocol: pack the adapter; start writing the persisted copy (temporary directory, then
rename) in a thread; stream to the samplers (announce over gRPC, broadcast over a side
torch.distributed group, wait for each sampler's commit); join the copy. The reply goes out only
when every sampler has committed AND the copy is complete, so whoever the caller hands
persisted_path to finds the whole adapter there and never has to wait for it. Either failing
fails the push.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
import time

from tinkerd import weight_stream
from tinkerd.rpc import ServiceAuth, channel
from tinkerd.v1 import sampler_pb2, sampler_pb2_grpc, trainer_pb2
from trainer_service.checkpoints import save_peft_adapter
from trainer_service.convert import tensor_specs

log = logging.getLogger(__name__)


def _start_copy(path: str, packed: weight_stream.Packed, config: dict) -> concurrent.futures.Future:
    """save_peft_adapter in its own thread (its large writes release the GIL, so it runs beside
    the stream); the future's result is its duration in seconds."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def write():
        t0 = time.perf_counter()
        try:
            save_peft_adapter(path, packed, config)
        except BaseException as e:  # noqa: BLE001 - handed to the push, which fails with it
            future.set_exception(e)
        else:
            future.set_result(time.perf_counter() - t0)
    threading.Thread(target=write, name="persisted-copy", daemon=True).start()
    return future


class WeightPusher:
    def __init__(self, advertise_host: str, transfer_timeout_s: float, auth: ServiceAuth = ServiceAuth()):
        self.advertise_host = advertise_host
        self.transfer_timeout_s = transfer_timeout_s
        self.auth = auth
        self._samplers: dict[str, sampler_pb2_grpc.SamplerStub] = {}

    def push(self, request: trainer_pb2.PushWeightsRequest, persisted: str, adapter: dict, config: dict, *,
             gather_seconds: float) -> trainer_pb2.PushWeightsResponse:
        """Streams the exported `adapter` as the request asks and, unless `persisted` is empty,
        writes its PEFT copy there; see the module docstring."""
        t0 = time.perf_counter()
        packed = weight_stream.pack(adapter)
        t_packed = time.perf_counter()
        copy = _start_copy(persisted, packed, config) if persisted else None
        try:
            if request.sampler_addresses:
                self._stream(request, packed, config, persisted)
        except BaseException:
            if copy is not None:
                concurrent.futures.wait([copy])    # no write goes on after the reply, a failed one included
            raise
        t_streamed = time.perf_counter()
        copy_seconds = copy.result() if copy is not None else 0.0
        reply = trainer_pb2.PushWeightsResponse(
            snapshot_id=request.snapshot_id, num_bytes=sum(packed.chunk_num_bytes), num_tensors=len(packed.specs),
            gather_seconds=gather_seconds, stream_seconds=t_streamed - t0, persisted_path=persisted)
        log.info("pushed %s: %d tensors, %d bytes, gather %.1f ms, pack %.1f ms, stream %.1f ms, "
                 "copy %.1f ms (%.1f ms of it after the stream)", request.snapshot_id, reply.num_tensors,
                 reply.num_bytes, 1e3 * gather_seconds, 1e3 * (t_packed - t0), 1e3 * (t_streamed - t_packed),
                 1e3 * copy_seconds, 1e3 * (time.perf_counter() - t_streamed))
        return reply

    def _stream(self, request, packed: weight_stream.Packed, config: dict, persisted: str) -> None:
        """Announce over gRPC, broadcast over the side group, then wait for each commit."""
        t0 = time.perf_counter()
        world = 1 + len(request.sampler_addresses)
        backend = weight_stream.default_backend()
        store = weight_stream.create_store(self.advertise_host, 0, world, is_master=True,
                                           timeout_s=self.transfer_timeout_s)
        specs = tensor_specs(packed)
        replies = []
        for rank, address in enumerate(request.sampler_addresses, start=1):
            manifest = sampler_pb2.WeightManifest(
                snapshot_id=request.snapshot_id, adapter_config_json=json.dumps(config), tensors=specs,
                chunk_num_bytes=packed.chunk_num_bytes, persisted_path=persisted,
                rendezvous=sampler_pb2.Rendezvous(host=self.advertise_host, port=store.port, rank=rank,
                                                  world_size=world, backend=backend,
                                                  timeout_seconds=self.transfer_timeout_s))
            replies.append(self._sampler(address).ReceiveWeights.future(manifest, timeout=self.transfer_timeout_s))
        t_announced = time.perf_counter()
        group = weight_stream.join_group(store, 0, world, backend, self.transfer_timeout_s, request.snapshot_id,
                                         bind_host=self.advertise_host)
        t_joined = time.perf_counter()
        weight_stream.send(group, packed.chunks)
        t_sent = time.perf_counter()
        for reply in replies:
            reply.result()
        log.info("stream %s: announce %.1f ms, join %.1f ms, send %.1f ms, commit %.1f ms", request.snapshot_id,
                 1e3 * (t_announced - t0), 1e3 * (t_joined - t_announced), 1e3 * (t_sent - t_joined),
                 1e3 * (time.perf_counter() - t_sent))

    def _sampler(self, address: str):
        """One channel per sampler replica, kept: a new one per push costs a connection setup."""
        stub = self._samplers.get(address)
        if stub is None:
            stub = self._samplers[address] = sampler_pb2_grpc.SamplerStub(channel(address, self.auth))
        return stub
