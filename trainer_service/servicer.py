"""Trainer gRPC servicer: per RPC, convert the message (convert.py), call the engine in the
model's fair turn, convert back. Weight pushes go through weight_push.py.

A resent (model_id, seq_id) gets the stored reply instead of running twice (replies.py).
Every directory is derived here from ids and names below the trainer's own state dir
(tinkerd/paths.py); none comes from the caller.
"""

from __future__ import annotations

import os
import time

from tinkerd import paths
from tinkerd.errors import UserError
from tinkerd.rpc import ServiceAuth, rpc_boundary
from tinkerd.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from trainer_service import convert
from trainer_service.engine import TrainerEngine
from trainer_service.replies import ReplyCache
from trainer_service.scheduler import FairScheduler, tenant_of
from trainer_service.weight_push import WeightPusher

# Checkpoint kinds SaveState writes (sampler_weights are PushWeights' persisted snapshots).
SAVE_KINDS = ("weights", "external_weights")


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, engine: TrainerEngine, *, state_dir: str, advertise_host: str = "127.0.0.1",
                 transfer_timeout_s: float = 120.0, auth: ServiceAuth = ServiceAuth()):
        self.engine = engine
        self.state_dir = os.path.abspath(state_dir)
        self.replies = ReplyCache()
        self.scheduler = FairScheduler()
        self.pusher = WeightPusher(advertise_host, transfer_timeout_s, auth)

    def _fair(self, model_id: str, fn):
        """Runs engine work when the model's tenant gets its turn (see scheduler.py)."""
        return self.scheduler.run(tenant_of(model_id), fn)

    def _info(self, model_id: str) -> trainer_pb2.ModelInfo:
        base = self.engine.base_model_dir
        if model_id in self.engine.model_ids()[1]:
            return convert.model_info(model_id, base, None)
        model = self.engine.get(model_id)
        return convert.model_info(model_id, base, model, self.engine.num_params(model))

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
        if request.HasField("load_checkpoint"):
            ref = request.load_checkpoint
            directory = paths.checkpoint_dir(self.state_dir, ref.model_id, ref.kind, ref.name)

            def create():
                if self.engine.is_resident(request.model_id):
                    return self.engine.get(request.model_id)   # a resent create
                return self.engine.load_state(request.model_id, directory, with_optimizer=request.load_optimizer)
        else:
            def create():
                return self.engine.create_model(request.model_id, convert.lora_spec(request.lora_config))
        self._fair(request.model_id, create)
        return self._info(request.model_id)

    @rpc_boundary
    def DeleteModel(self, request, context):
        self.replies.forget(request.model_id)
        return trainer_pb2.DeleteModelResponse(
            deleted=self._fair(request.model_id, lambda: self.engine.delete_model(request.model_id)))

    @rpc_boundary
    def SaveState(self, request, context):
        if request.kind not in SAVE_KINDS:
            raise UserError(f"checkpoint kind {request.kind!r} must be one of {SAVE_KINDS}")
        directory = paths.checkpoint_dir(self.state_dir, request.model_id, request.kind, request.name)

        def save():
            size = self._fair(request.model_id, lambda: self.engine.save_state(
                request.model_id, directory, with_optimizer=request.with_optimizer))
            return trainer_pb2.SaveStateResponse(directory=directory, size_bytes=size)
        return self.replies.once(request.model_id, request.seq_id, "save_state", save)

    @rpc_boundary
    def UnloadModel(self, request, context):
        target = paths.unloaded_dir(self.state_dir, request.model_id)
        directory = self._fair(request.model_id, lambda: self.engine.unload_model(request.model_id, target))
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
        data = [convert.datum(d, i) for i, d in enumerate(request.data)]
        outputs, metrics = self._fair(request.model_id, lambda: self.engine.forward_backward(
            request.model_id, data, request.loss_fn, dict(request.loss_fn_config),
            forward_only=request.forward_only))
        return convert.forward_backward_response(outputs, metrics)

    @rpc_boundary
    def OptimStep(self, request, context):
        adam = convert.adam_params(request.adam_params)
        return self.replies.once(request.model_id, request.seq_id, "optim_step", lambda: trainer_pb2.OptimStepResponse(
            metrics=self._fair(request.model_id, lambda: self.engine.optim_step(request.model_id, adam))))

    @rpc_boundary
    def PushWeights(self, request, context):
        return self.replies.once(request.model_id, request.seq_id, "push_weights", lambda: self._push(request))

    def _push(self, request) -> trainer_pb2.PushWeightsResponse:
        if not request.snapshot_id:
            raise UserError("snapshot_id is required")
        persisted = paths.snapshot_dir(self.state_dir, request.snapshot_id) if request.persist else ""
        t0 = time.perf_counter()
        packed, config = self._fair(request.model_id, lambda: self.engine.snapshot_adapter(request.model_id))
        return self.pusher.push(request, persisted, packed, config, gather_seconds=time.perf_counter() - t0)
