"""Trainer gRPC servicer: per RPC, convert the message (convert.py), call the engine in the
model's fair turn, convert back. Weight pushes go through weight_push.py.

A resent (model_id, seq_id) gets the stored reply instead of running twice (replies.py), also
after a restart for what the model's durable state includes (durable.py); a model that lost
work in a restart says so once. A model's requests execute in seq_id order whichever gateway
sends them (seq_order.py).
Every directory is derived here from ids and names below the trainer's own state dir
(tinkerd/paths.py); none comes from the caller.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from tinkerd import paths
from tinkerd.errors import LostWorkError, UserError
from tinkerd.rpc import ServiceAuth, rpc_boundary
from tinkerd.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from trainer_service import convert, metrics
from trainer_service.engine import TrainerEngine
from trainer_service.durable import IDLE_WRITE_AFTER_S, DurableModels, describe_lost
from trainer_service.replies import APPLIED, ReplyCache
from trainer_service.scheduler import FairScheduler, tenant_of
from trainer_service.seq_order import SeqOrder
from trainer_service.weight_push import WeightPusher

log = logging.getLogger(__name__)

# Checkpoint kinds SaveState writes (sampler_weights are PushWeights' persisted snapshots).
SAVE_KINDS = ("weights", "external_weights")


# The replies a restarted trainer can give again (durable.py journals them).
_REPLY_TYPES = {"optim_step": trainer_pb2.OptimStepResponse}


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, engine: TrainerEngine, *, state_dir: str, advertise_host: str = "127.0.0.1",
                 transfer_timeout_s: float = 120.0, auth: ServiceAuth = ServiceAuth(),
                 durable_interval_s: float = 10.0):
        self.engine = engine
        self.state_dir = os.path.abspath(state_dir)
        if engine.durable is None:
            engine.attach_durable(DurableModels(self.state_dir, durable_interval_s))
        self.durable = engine.durable
        self.replies = ReplyCache()
        self.order = SeqOrder()
        self.scheduler = FairScheduler()
        self.pusher = WeightPusher(advertise_host, transfer_timeout_s, auth, device=engine.device)
        threading.Thread(target=self._write_when_idle, name="durable-writer", daemon=True).start()

    def _fair(self, model_id: str, fn, context=None):
        """Runs engine work when the tenant's turn comes (see scheduler.py): the user the gateway
        names in the call's metadata, else the model's session (work of the trainer's own)."""
        metadata = context.invocation_metadata() if context is not None else ()
        return self.scheduler.run(tenant_of(model_id, metadata), fn)

    def _once(self, request, kind: str, work, context):
        """`work()` in the model's fair turn, at most once per (model_id, seq_id): a resend gets
        the first reply, also after a restart for what the durable state includes."""
        model_id, seq = request.model_id, request.seq_id
        cached = self.replies.get(model_id, seq, kind)
        if cached is not None:
            return cached
        ran_before = self.order.wait_turn(model_id, seq)
        applied = True
        try:
            cached = self.replies.get(model_id, seq, kind)    # the same request, sent meanwhile by another gateway
            if cached is not None:
                return cached
            if ran_before:
                raise _expired(kind, model_id, seq)
            applied = False
            reply = self._fair(model_id, self._turn(request, kind, work), context)
            applied = True
            return reply
        finally:
            self.order.executed(model_id, seq, applied)

    def _turn(self, request, kind: str, work):
        model_id, seq = request.model_id, request.seq_id

        def turn():
            self._resume(model_id, seq)
            again = self.replies.get(model_id, seq, kind)     # a resume may know it
            if again is not None:
                return again
            reply = work()
            self.replies.put(model_id, seq, kind, reply)
            return reply
        return turn

    def _resume(self, model_id: str, seq: int) -> None:
        """Brings back a model that is not resident. Its journal tells which requests its durable
        state includes (their replies are kept for resends) and which it lost in a crash: then
        this request is refused, once, saying so -- unless it is the resend of the one request
        lost (the call in flight when the trainer died), which redoes exactly what was lost."""
        if self.engine.is_resident(model_id) or not self.engine.on_disk(model_id):
            return
        model = self.engine.get(model_id)
        entries = self.durable.journal(model_id)
        for e in entries:
            if e.seq <= model.state_seq:
                reply = _REPLY_TYPES[e.kind].FromString(e.reply) if e.reply is not None else APPLIED
                self.replies.put(model_id, e.seq, e.kind, reply)
        lost = [e for e in entries if e.seq > model.state_seq]
        if lost and [e.seq for e in lost] == [seq]:
            self.durable.trim(model_id, model.state_seq)
        elif lost:
            self.durable.trim(model_id, model.state_seq)
            raise LostWorkError(
                f"the trainer restarted and model {model_id} resumed from its state at step {model.step} "
                f"(seq_id {model.state_seq}); these requests were done but are lost: {describe_lost(lost)}. "
                f"Send them again to redo them; requests from now on apply to the resumed state")

    def _write_when_idle(self) -> None:
        """Writes the durable state of models that are behind once the engine has been idle a while."""
        while True:
            time.sleep(IDLE_WRITE_AFTER_S / 2)
            if self.scheduler.idle_for() < IDLE_WRITE_AFTER_S:
                continue
            for model_id in self.engine.behind():
                try:
                    self._fair(model_id, lambda: self.engine.save_durable(model_id))
                except Exception:  # noqa: BLE001 - retried on the next idle tick
                    log.exception("could not write the durable state of %s", model_id)
                if self.scheduler.idle_for() < IDLE_WRITE_AFTER_S:
                    break

    def _info(self, model_id: str) -> trainer_pb2.ModelInfo:
        base = self.engine.base_model_dir
        if not self.engine.is_resident(model_id) and self.engine.on_disk(model_id):
            return convert.model_info(model_id, base, None)
        model = self.engine.get(model_id)
        return convert.model_info(model_id, base, model, self.engine.num_params(model))

    @rpc_boundary
    def Health(self, request, context):
        broken = self.engine.ranks.broken       # a rank of the job died or diverged
        return common_pb2.HealthResponse(ready=broken is None, base_model=self.engine.base_model_dir,
                                         detail=f"trainer job broken: {broken}" if broken else "")

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
                if self.engine.is_resident(request.model_id) or self.engine.on_disk(request.model_id):
                    return self.engine.get(request.model_id)   # a resent create
                return self.engine.load_state(request.model_id, directory, with_optimizer=request.load_optimizer)
        else:
            def create():
                return self.engine.create_model(request.model_id, convert.lora_spec(request.lora_config))
            self.order.created(request.model_id)
        self._fair(request.model_id, create, context)
        return self._info(request.model_id)

    @rpc_boundary
    def DeleteModel(self, request, context):
        self.replies.forget(request.model_id)
        self.order.forget(request.model_id)
        return trainer_pb2.DeleteModelResponse(
            deleted=self._fair(request.model_id, lambda: self.engine.delete_model(request.model_id), context))

    @rpc_boundary
    def SaveState(self, request, context):
        if request.kind not in SAVE_KINDS:
            raise UserError(f"checkpoint kind {request.kind!r} must be one of {SAVE_KINDS}")
        directory = paths.checkpoint_dir(self.state_dir, request.model_id, request.kind, request.name)

        def save():
            size = self.engine.save_state(request.model_id, directory, with_optimizer=request.with_optimizer)
            return trainer_pb2.SaveStateResponse(directory=directory, size_bytes=size)
        return self._once(request, "save_state", save, context)

    @rpc_boundary
    def UnloadModel(self, request, context):
        directory = self._fair(request.model_id, lambda: self.engine.unload_model(request.model_id), context)
        return trainer_pb2.UnloadModelResponse(directory=directory)

    @rpc_boundary
    def SkipSeq(self, request, context):
        """A seq_id refused at the gateway: taken in its turn and marked as not applied, so the
        next seq_id does not wait out the gap timeout for it (seq_order.py)."""
        self.order.wait_turn(request.model_id, request.seq_id)
        self.order.executed(request.model_id, request.seq_id, applied=False)
        return trainer_pb2.SkipSeqResponse()

    @rpc_boundary
    def GetQueueState(self, request, context):
        snap = self.scheduler.snapshot()
        return trainer_pb2.QueueState(running_tenant=snap.running or "", queued=snap.queued)

    @rpc_boundary
    def ForwardBackward(self, request, context):
        kind = "forward" if request.forward_only else "forward_backward"
        return self._once(request, kind, lambda: self._forward_backward(request), context)

    def _forward_backward(self, request) -> trainer_pb2.ForwardBackwardResponse:
        data = [convert.datum(d, i) for i, d in enumerate(request.data)]
        kind = "forward" if request.forward_only else "forward_backward"
        with metrics.STEP_SECONDS.labels(kind).time():
            custom = ((request.custom_loss.loss_id, request.custom_loss.spec_json)
                      if request.HasField("custom_loss") else None)
            outputs, loss_metrics = self.engine.forward_backward(request.model_id, data, request.loss_fn,
                                                                 dict(request.loss_fn_config),
                                                                 forward_only=request.forward_only,
                                                                 custom_loss=custom)
        metrics.TOKENS.labels(kind).inc(metrics.tokens_of(data))
        if not request.forward_only:
            self.durable.record(request.model_id, request.seq_id, "forward_backward")
        return convert.forward_backward_response(outputs, loss_metrics)

    @rpc_boundary
    def OptimStep(self, request, context):
        adam = convert.adam_params(request.adam_params)

        def step():
            with metrics.STEP_SECONDS.labels("optim_step").time():
                step_metrics = self.engine.optim_step(request.model_id, adam, seq=request.seq_id)
            reply = trainer_pb2.OptimStepResponse(metrics=step_metrics)
            self.durable.record(request.model_id, request.seq_id, "optim_step", reply.SerializeToString())
            if self.durable.due(request.model_id):
                self.engine.save_durable(request.model_id)
            return reply
        return self._once(request, "optim_step", step, context)

    @rpc_boundary
    def PushWeights(self, request, context):
        if not request.snapshot_id:
            raise UserError("snapshot_id is required")
        cached = self.replies.get(request.model_id, request.seq_id, "push_weights")
        if cached is not None:
            return cached
        ran_before = self.order.wait_turn(request.model_id, request.seq_id)
        applied = False
        try:
            reply = self._push(request, ran_before, context)
            applied = True
            return reply
        finally:
            self.order.executed(request.model_id, request.seq_id, applied or ran_before)

    def _push(self, request, ran_before: bool, context) -> trainer_pb2.PushWeightsResponse:
        cached = self.replies.get(request.model_id, request.seq_id, "push_weights")
        if cached is not None:     # the same push, sent meanwhile by another gateway
            return cached
        if ran_before:
            raise _expired("push_weights", request.model_id, request.seq_id)

        def export():
            self._resume(request.model_id, request.seq_id)
            return self.engine.snapshot_adapter(request.model_id)
        t0 = time.perf_counter()
        packed, config = self._fair(request.model_id, export, context)     # the transfer runs outside the turn
        persisted = paths.snapshot_dir(self.state_dir, request.snapshot_id) if request.persist else ""
        reply = self.pusher.push(request, persisted, packed, config, gather_seconds=time.perf_counter() - t0)
        metrics.pushed(reply, time.perf_counter() - t0)
        self.replies.put(request.model_id, request.seq_id, "push_weights", reply)
        return reply


def _expired(kind: str, model_id: str, seq: int) -> UserError:
    """A late copy of a request that executed here and whose reply was since dropped
    (replies.py keeps the latest within a byte budget): applying it again would apply it twice."""
    return UserError(f"{kind} seq_id {seq} of {model_id} was already executed and its result is no longer "
                     f"kept (later requests pushed it out of the trainer's reply cache); it is not applied "
                     f"twice. Send a new request")
