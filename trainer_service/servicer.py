"""Trainer gRPC servicer: per RPC, convert the message (convert.py), call the engine in the
model's fair turn (scheduler.py), convert back. Weight pushes go through weight_push.py.

Every request that changes a model is handed to the ledger (ledger.py) with the engine work it
asks for: the ledger runs it at most once per (model_id, seq_id), in seq_id order whichever
gateway sends it, brings a model back from disk first, journals it, and answers a resend with the
first reply, also after a restart for what the model's durable state includes.
Every directory is derived here from ids and names below the trainer's own state dir
(tinkerd/paths.py); none comes from the caller.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time

from tinkerd import age, paths, weight_stream, weight_transport
from tinkerd.errors import UserError
from tinkerd.rpc import ServiceAuth
from tinkerd.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from trainer_service import convert, metrics
from trainer_service.engine import TrainerEngine
from trainer_service.durable import IDLE_WRITE_AFTER_S, DurableModels
from trainer_service.ledger import Ledger
from trainer_service.scheduler import FairScheduler, tenant_of
from trainer_service.weight_push import WeightPusher

log = logging.getLogger(__name__)

# Checkpoint kinds SaveState writes (sampler_weights are PushWeights' persisted snapshots).
SAVE_KINDS = ("weights", "external_weights")


def _tenant(model_id: str, context) -> str:
    """Whose turn the call's work takes (scheduler.py): the user its metadata names, else the model's session."""
    return tenant_of(model_id, context.invocation_metadata() if context is not None else ())


@dataclasses.dataclass
class _Snapshot:
    """A model's adapter gathered for a push (engine.snapshot_adapter), and when."""
    packed: weight_stream.Packed
    config: dict
    started: float              # perf_counter at the gather's start
    gather_seconds: float


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, engine: TrainerEngine, *, state_dir: str, advertise_host: str = "127.0.0.1",
                 transfer_timeout_s: float = 120.0, auth: ServiceAuth = ServiceAuth(),
                 durable_interval_s: float = 10.0, weight_transports: list[str] | tuple[str, ...] = (),
                 durable_idle_s: float = IDLE_WRITE_AFTER_S):
        self.engine = engine
        self.state_dir = os.path.abspath(state_dir)
        if engine.durable is None:
            engine.attach_durable(DurableModels(self.state_dir, durable_interval_s))
        self.scheduler = FairScheduler()
        self.ledger = Ledger(engine.durable, engine, self.scheduler)
        self.pusher = WeightPusher(advertise_host, transfer_timeout_s, auth, device=engine.device,
                                   transports=weight_transports or weight_transport.PREFERENCE)
        if durable_idle_s > 0:
            threading.Thread(target=self._write_when_idle, args=(durable_idle_s,), name="durable-writer",
                             daemon=True).start()

    def _fair(self, model_id: str, fn, context=None):
        """Runs engine work when the tenant's turn comes (see scheduler.py): the user the gateway
        names in the call's metadata, else the model's session (work of the trainer's own)."""
        return self.scheduler.run(_tenant(model_id, context), fn)

    def write_behind(self, timeout_s: float) -> None:
        """At a clean stop, once no call is left: the durable state of every model that is behind
        (steps within --durable-interval-s, a write queued after a reply), so a restart loses no
        step. Models left when `timeout_s` is up stay behind: the restart says what they lost."""
        deadline = time.monotonic() + timeout_s
        behind, written = self.engine.behind(), 0
        for n, model_id in enumerate(behind):
            if time.monotonic() > deadline:
                log.warning("stopping: %d of %d models not written in %.0f s; their restart will say what "
                            "was lost", len(behind) - n, len(behind), timeout_s)
                return
            written += self._save_durable(model_id)
        if behind:
            log.info("stopping: durable state of %d of %d models written", written, len(behind))

    def _save_durable(self, model_id: str) -> bool:
        """The model's durable state written in its fair turn; False, logged, if that failed (the
        caller goes on to the next model; this one stays behind, to be tried again)."""
        try:
            self._fair(model_id, lambda: self.engine.save_durable(model_id))
            return True
        except Exception:  # noqa: BLE001 - the other models' states are still worth writing
            log.exception("could not write the durable state of %s", model_id)
            return False

    def _write_when_idle(self, idle_s: float) -> None:
        """Writes the durable state of models that are behind once the engine has been idle `idle_s`."""
        while True:
            time.sleep(idle_s / 2)
            if self.scheduler.idle_for() < idle_s:
                continue
            for model_id in self.engine.behind():
                self._save_durable(model_id)           # a failed one is tried again on the next idle tick
                if self.scheduler.idle_for() < idle_s:
                    break

    def _info(self, model_id: str) -> trainer_pb2.ModelInfo:
        base = self.engine.base_model_dir
        if not self.engine.is_resident(model_id) and self.engine.on_disk(model_id):
            return convert.model_info(model_id, base, None)
        model = self.engine.get(model_id)
        return convert.model_info(model_id, base, model, self.engine.num_params(model))

    def Health(self, request, context):
        broken = self.engine.ranks.broken       # a rank of the job died or diverged
        return common_pb2.HealthResponse(ready=broken is None, base_model=self.engine.base_model_dir,
                                         detail=f"trainer job broken: {broken}" if broken else "")

    def CreateModel(self, request, context):
        if request.base_model and not self.engine.accepts_base_model(request.base_model):
            raise UserError(f"base model {request.base_model!r} is not served here; this trainer serves "
                            f"{sorted(self.engine.base_model_names)}")
        if not request.model_id:
            raise UserError("model_id is required")
        directory = None          # the checkpoint to start from, if any
        if request.HasField("load_checkpoint"):
            ref = request.load_checkpoint
            directory = paths.checkpoint_dir(self.state_dir, ref.model_id, ref.kind, ref.name)

        def create():
            if self.engine.is_resident(request.model_id) or self.engine.on_disk(request.model_id):
                return self.engine.get(request.model_id)   # a resent create: its order goes on
            optimizer = convert.optimizer(request.optimizer)
            if directory is not None:
                model = self.engine.load_state(request.model_id, directory, with_optimizer=request.load_optimizer,
                                               optimizer=optimizer)
            else:
                model = self.engine.create_model(request.model_id, convert.lora_spec(request.lora_config, optimizer))
            self.ledger.created(request.model_id, request.after_seq_id)
            return model
        # Made here, the model's order starts at seq_id 1, before any request of it can come (the
        # gateway sends them once the creation is answered): its first steps, which may arrive
        # together and in any order, run in order (ledger.created), also after a restart. A resent
        # create leaves the order as it is (starting it again would count its steps as not applied).
        self._fair(request.model_id, create, context)
        return self._info(request.model_id)

    def DeleteModel(self, request, context):
        self.ledger.forget(request.model_id)
        return trainer_pb2.DeleteModelResponse(
            deleted=self._fair(request.model_id, lambda: self.engine.delete_model(request.model_id), context))

    def SaveState(self, request, context):
        if request.kind not in SAVE_KINDS:
            raise UserError(f"checkpoint kind {request.kind!r} must be one of {SAVE_KINDS}")
        if request.age_recipients:
            if request.kind != "external_weights":
                raise UserError("age_recipients: only an export (external_weights) is encrypted")
            age.recipients(request.age_recipients)
        directory = paths.checkpoint_dir(self.state_dir, request.model_id, request.kind, request.name)
        work = functools.partial(self.engine.save_state, request.model_id, directory,
                                 with_optimizer=request.with_optimizer,
                                 age_recipients=list(request.age_recipients))      # plain: sent to every rank
        return self.ledger.run(request, "save_state", work, tenant=_tenant(request.model_id, context),
                               reply=functools.partial(convert.save_state_response, directory))

    def UnloadModel(self, request, context):
        directory = self._fair(request.model_id, lambda: self.engine.unload_model(request.model_id), context)
        return trainer_pb2.UnloadModelResponse(directory=directory)

    def SkipSeq(self, request, context):
        """A seq_id refused at the gateway: taken in its turn and marked as not applied, so the
        next seq_id does not wait out the gap timeout for it (seq_order.py). With
        `through_seq_id`: a gap the gateway waited out, not waited out here again."""
        if request.through_seq_id > request.seq_id:
            self.ledger.waive(request.model_id, request.seq_id, request.through_seq_id)
        else:
            self.ledger.skip(request.model_id, request.seq_id)
        return trainer_pb2.SkipSeqResponse()

    def GetQueueState(self, request, context):
        snap = self.scheduler.snapshot()
        return trainer_pb2.QueueState(running_tenant=snap.running or "", queued=snap.queued)

    def ForwardBackward(self, request, context):
        kind = "forward" if request.forward_only else "forward_backward"
        try:
            data = [convert.datum(d, i) for i, d in enumerate(request.data)]      # sparse made dense
        except UserError:
            self.ledger.refused(request)        # as a failed step: the next seq_id does not wait for it
            raise
        custom = (request.custom_loss.loss_id, request.custom_loss.spec_json) if request.HasField("custom_loss") \
            else None
        work = functools.partial(self.engine.forward_backward, request.model_id, data, request.loss_fn,
                                 dict(request.loss_fn_config), forward_only=request.forward_only, custom_loss=custom)
        return self.ledger.run(request, kind, work, tenant=_tenant(request.model_id, context),
                               reply=convert.forward_backward_response,
                               ran=functools.partial(metrics.stepped, kind, data))

    def OptimStep(self, request, context):
        params = convert.optim_params(request)
        work = functools.partial(self.engine.optim_step, request.model_id, params, seq=request.seq_id)
        return self.ledger.run(request, "optim_step", work, tenant=_tenant(request.model_id, context),
                               reply=convert.optim_step_response,
                               ran=functools.partial(metrics.stepped, "optim_step", ()))

    def PushWeights(self, request, context):
        if not request.snapshot_id:
            raise UserError("snapshot_id is required")
        return self.ledger.run(request, "push_weights", lambda: self._snapshot(request),
                               tenant=_tenant(request.model_id, context),
                               outside_turn=lambda snapshot: self._push(request, snapshot))

    def _snapshot(self, request) -> _Snapshot:
        """The adapter gathered in the model's turn; the transfer (`_push`) runs after it."""
        t0 = time.perf_counter()
        packed, config = self.engine.snapshot_adapter(request.model_id)
        return _Snapshot(packed, config, started=t0, gather_seconds=time.perf_counter() - t0)

    def _push(self, request, snapshot: _Snapshot) -> trainer_pb2.PushWeightsResponse:
        persisted = paths.snapshot_dir(self.state_dir, request.snapshot_id) if request.persist else ""
        reply = self.pusher.push(request, persisted, snapshot.packed, snapshot.config,
                                 gather_seconds=snapshot.gather_seconds)
        metrics.pushed(reply, time.perf_counter() - snapshot.started)
        return reply
