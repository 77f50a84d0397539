"""Trainer gRPC servicer: per RPC, convert the message, call the engine, convert back.

A resent (model_id, seq_id) gets the stored reply instead of running twice.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time

import torch

from tinkerd import dtypes, tensors, weight_stream
from tinkerd.errors import UserError
from tinkerd.paths import dir_name
from tinkerd.rpc import channel, rpc_boundary
from tinkerd.v1 import common_pb2, sampler_pb2, sampler_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from trainer_service.engine import AdamParams, DatumInput, TrainerEngine, save_peft_adapter
from trainer_service.lora import LoraSpec
from trainer_service.scheduler import FairScheduler, tenant_of

log = logging.getLogger(__name__)

_REPLIES_KEPT_PER_MODEL = 256


class ReplyCache:
    """Replies by (model_id, seq_id), so a resent request is answered, not re-executed."""

    def __init__(self):
        self._by_model: dict[str, collections.OrderedDict] = collections.defaultdict(collections.OrderedDict)
        self._lock = threading.Lock()

    def get(self, model_id: str, seq_id: int, kind: str):
        with self._lock:
            hit = self._by_model[model_id].get(seq_id)
        if hit is None:
            return None
        if hit[0] != kind:
            raise UserError(f"seq_id {seq_id} of {model_id} was already used by a {hit[0]} request")
        return hit[1]

    def put(self, model_id: str, seq_id: int, kind: str, reply) -> None:
        with self._lock:
            replies = self._by_model[model_id]
            replies[seq_id] = (kind, reply)
            while len(replies) > _REPLIES_KEPT_PER_MODEL:
                replies.popitem(last=False)

    def once(self, model_id: str, seq_id: int, kind: str, compute):
        """The stored reply for (model_id, seq_id), else `compute()`'s, stored."""
        cached = self.get(model_id, seq_id, kind)
        if cached is None:
            cached = compute()
            self.put(model_id, seq_id, kind, cached)
        return cached

    def forget(self, model_id: str) -> None:
        with self._lock:
            self._by_model.pop(model_id, None)


def _lora_spec(msg: common_pb2.LoraConfig) -> LoraSpec:
    return LoraSpec(rank=msg.rank, seed=msg.seed if msg.HasField("seed") else None,
                    train_attn=msg.train_attn, train_mlp=msg.train_mlp, train_unembed=msg.train_unembed)


def _datum(msg: common_pb2.Datum, index: int) -> DatumInput:
    inputs = {}
    for key, t in msg.loss_fn_inputs.items():
        try:
            inputs[key] = torch.from_numpy(tensors.to_numpy(t).copy())
        except ValueError as e:
            raise UserError(f"datum {index}: loss_fn_inputs[{key!r}]: {e}") from None
    return DatumInput(list(msg.tokens), inputs)


def _wire_dtype(name: str) -> int:
    wire = dtypes.by_name(name).wire
    if wire is None:
        raise ValueError(f"dtype {name} has no tinkerd.v1 DType")
    return wire


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, engine: TrainerEngine, *, advertise_host: str = "127.0.0.1",
                 transfer_timeout_s: float = 120.0):
        self.engine = engine
        self.advertise_host = advertise_host
        self.transfer_timeout_s = transfer_timeout_s
        self.replies = ReplyCache()
        self.scheduler = FairScheduler()
        self._samplers: dict[str, sampler_pb2_grpc.SamplerStub] = {}

    def _fair(self, model_id: str, fn):
        """Runs engine work when the model's tenant gets its turn (see scheduler.py)."""
        return self.scheduler.run(tenant_of(model_id), fn)

    def _info(self, model_id: str) -> trainer_pb2.ModelInfo:
        if model_id in self.engine.model_ids()[1]:
            return trainer_pb2.ModelInfo(model_id=model_id, base_model=self.engine.base_model_dir, resident=False)
        m = self.engine.get(model_id)
        s = m.spec
        lora = common_pb2.LoraConfig(rank=s.rank, train_attn=s.train_attn, train_mlp=s.train_mlp,
                                     train_unembed=s.train_unembed)
        if s.seed is not None:
            lora.seed = s.seed
        return trainer_pb2.ModelInfo(model_id=model_id, base_model=self.engine.base_model_dir, lora_config=lora,
                                     step=m.step, num_params=self.engine.num_params(m), resident=True)

    @rpc_boundary
    def Health(self, request, context):
        return common_pb2.HealthResponse(ready=True, base_model=self.engine.base_model_dir)

    @rpc_boundary
    def CreateModel(self, request, context):
        if request.base_model and not self.engine.accepts_base_model(request.base_model):
            raise UserError(f"base model {request.base_model!r} is not served here; this trainer serves "
                            f"{sorted(self.engine.base_model_names)}")
        if not request.model_id:
            raise UserError("model_id is required")
        if request.load_from:
            def create():
                if self.engine.is_resident(request.model_id):
                    return self.engine.get(request.model_id)   # a resent create
                return self.engine.load_state(request.model_id, request.load_from,
                                              with_optimizer=request.load_optimizer)
        else:
            def create():
                return self.engine.create_model(request.model_id, _lora_spec(request.lora_config))
        self._fair(request.model_id, create)
        return self._info(request.model_id)

    @rpc_boundary
    def DeleteModel(self, request, context):
        self.replies.forget(request.model_id)
        return trainer_pb2.DeleteModelResponse(
            deleted=self._fair(request.model_id, lambda: self.engine.delete_model(request.model_id)))

    @rpc_boundary
    def SaveState(self, request, context):
        if not request.directory:
            raise UserError("directory is required")

        def save():
            size = self._fair(request.model_id, lambda: self.engine.save_state(
                request.model_id, request.directory, with_optimizer=request.with_optimizer))
            return trainer_pb2.SaveStateResponse(directory=request.directory, size_bytes=size)
        return self.replies.once(request.model_id, request.seq_id, "save_state", save)

    @rpc_boundary
    def UnloadModel(self, request, context):
        if not request.directory:
            raise UserError("directory is required")
        directory = self._fair(request.model_id, lambda: self.engine.unload_model(request.model_id,
                                                                                   request.directory))
        return trainer_pb2.UnloadModelResponse(directory=directory)

    @rpc_boundary
    def GetQueueState(self, request, context):
        snap = self.scheduler.snapshot()
        return trainer_pb2.QueueState(running_tenant=snap.running or "", queued=snap.queued)

    @rpc_boundary
    def ForwardBackward(self, request, context):
        kind = "forward" if request.forward_only else "forward_backward"
        return self.replies.once(request.model_id, request.seq_id, kind, lambda: self._forward_backward(request))

    def _forward_backward(self, request) -> trainer_pb2.ForwardBackwardResponse:
        data = [_datum(d, i) for i, d in enumerate(request.data)]
        outputs, metrics = self._fair(request.model_id, lambda: self.engine.forward_backward(
            request.model_id, data, request.loss_fn, dict(request.loss_fn_config),
            forward_only=request.forward_only))
        return trainer_pb2.ForwardBackwardResponse(
            outputs=[trainer_pb2.DatumOutput(outputs={k: tensors.from_numpy(v.numpy()) for k, v in o.items()})
                     for o in outputs],
            metrics=metrics)

    @rpc_boundary
    def OptimStep(self, request, context):
        a = request.adam_params
        adam = AdamParams(learning_rate=a.learning_rate, beta1=a.beta1, beta2=a.beta2, eps=a.eps,
                          weight_decay=a.weight_decay, grad_clip_norm=a.grad_clip_norm)
        return self.replies.once(request.model_id, request.seq_id, "optim_step", lambda: trainer_pb2.OptimStepResponse(
            metrics=self._fair(request.model_id, lambda: self.engine.optim_step(request.model_id, adam))))

    @rpc_boundary
    def PushWeights(self, request, context):
        return self.replies.once(request.model_id, request.seq_id, "push_weights", lambda: self._push(request))

    def _push(self, request) -> trainer_pb2.PushWeightsResponse:
        if not request.snapshot_id:
            raise UserError("snapshot_id is required")
        t0 = time.perf_counter()
        adapter, config = self._fair(request.model_id, lambda: self.engine.export_adapter(request.model_id))
        t1 = time.perf_counter()
        persisted = ""
        if request.persist_dir:
            persisted = os.path.join(request.persist_dir, dir_name(request.snapshot_id))
        packed = weight_stream.pack(adapter)
        t_packed = time.perf_counter()
        if request.sampler_addresses:
            self._stream(request, packed, config, persisted)
        t2 = time.perf_counter()
        if persisted:
            # After the stream, not during it (it would compete for the CPU): the copy only matters
            # if a sampler must reload an evicted snapshot, or for a named checkpoint.
            threading.Thread(target=save_peft_adapter, args=(persisted, packed, config), daemon=True).start()
        reply = trainer_pb2.PushWeightsResponse(
            snapshot_id=request.snapshot_id, num_bytes=sum(packed.chunk_num_bytes),
            num_tensors=len(packed.specs), gather_seconds=t1 - t0, stream_seconds=t2 - t1, persisted_path=persisted)
        log.info("pushed %s: %d tensors, %d bytes, gather %.1f ms, pack %.1f ms, stream %.1f ms",
                 request.snapshot_id, reply.num_tensors, reply.num_bytes, 1e3 * reply.gather_seconds,
                 1e3 * (t_packed - t1), 1e3 * (t2 - t_packed))
        return reply

    def _stream(self, request, packed: weight_stream.Packed, config: dict, persisted: str) -> None:
        """Announce over gRPC, broadcast over the side group, then wait for each commit."""
        t0 = time.perf_counter()
        world = 1 + len(request.sampler_addresses)
        backend = weight_stream.default_backend()
        store = weight_stream.create_store(self.advertise_host, 0, world, is_master=True,
                                           timeout_s=self.transfer_timeout_s)
        specs = [sampler_pb2.TensorSpec(name=s.name, dtype=_wire_dtype(s.dtype), shape=s.shape,
                                        chunk=s.chunk, offset=s.offset) for s in packed.specs]
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
        group = weight_stream.join_group(store, 0, world, backend, self.transfer_timeout_s, request.snapshot_id)
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
            stub = self._samplers[address] = sampler_pb2_grpc.SamplerStub(channel(address))
        return stub

