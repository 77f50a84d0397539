"""Sampler gRPC servicer: per RPC, convert the message (convert.py), call the engine, convert
back; and receive streamed weight snapshots. A persisted adapter path (named by the gateway for
a sample, or by the trainer for a snapshot) is used only if it lies below this replica's state
dir's snapshots/ or checkpoints/ (tinkerd/paths.py). A replica that does not hold the snapshot
waits for its persisted copy if the trainer is still writing it (tinkerd/persisted_copy.py)."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import time

import grpc

from tinkerd import paths, persisted_copy
from tinkerd.errors import NotFoundError, ServiceError, UserError
from tinkerd.v1 import common_pb2, sampler_pb2, sampler_pb2_grpc
from sampler_service import convert, metrics
from sampler_service.engine import SamplerEngine
from sampler_service.weight_receiver import WeightReceiver

log = logging.getLogger(__name__)

_RESULT_TIMEOUT_S = 600.0
# How long a sample waits for a snapshot's persisted copy the trainer is still writing (it takes
# well under a second; then the caller gets a retryable error).
COPY_WAIT_S = 30.0


class SampleCancelled(ServiceError):
    code = grpc.StatusCode.CANCELLED


class SamplerServicer(sampler_pb2_grpc.SamplerServicer):
    def __init__(self, engine: SamplerEngine, *, state_dir: str):
        self.engine = engine
        self.state_dir = state_dir
        self.weights = WeightReceiver()

    def _adapter_path(self, path: str) -> str:
        return paths.adapter_path(self.state_dir, path) if path else ""

    def Health(self, request, context):
        return common_pb2.HealthResponse(ready=True, base_model=self.engine.model_dir,
                                         weight_endpoint=self.weights.endpoint.message())

    def Sample(self, request, context):
        if request.num_samples < 1:
            raise UserError(f"num_samples must be at least 1, got {request.num_samples}")
        targets = convert.prompt_targets(request, self.engine.vocab_size)
        if targets is not None and not self.engine.scores_prompt_targets:
            raise UserError("target_prompt_logprobs is not served by this sampler: its vLLM model runner has no "
                            "prompt-scoring hook (sampler_service/worker_ext.py)")
        params = convert.sampling_params(request, targets)
        path = self._adapter_path(request.snapshot_path)
        if path and not self._holds(request.snapshot_id):
            persisted_copy.wait_for(path, COPY_WAIT_S)
        future = self.engine.generate(list(request.prompt_tokens), params, request.num_samples, request.snapshot_id,
                                      path, request.cache_namespace)
        # The caller cancelled (cancel_future) or went away: stop generating for nobody.
        if not context.add_callback(lambda: self.engine.abort(future)):
            self.engine.abort(future)          # it ended before the callback could be added
        try:
            outputs = future.result(_RESULT_TIMEOUT_S)
        except concurrent.futures.CancelledError:
            raise SampleCancelled("the caller cancelled this sample; it was aborted") from None
        return convert.sample_response(request, outputs, targets)

    def _holds(self, snapshot_id: str) -> bool:
        try:
            return self.engine.snapshot(snapshot_id) is not None
        except NotFoundError:
            return False

    def ReceiveWeights(self, request, context):
        t0 = time.perf_counter()
        persisted = self._adapter_path(request.persisted_path)
        received = self.weights.receive(request, lambda: self._layout_of_new(request))
        t_received = time.perf_counter()
        self.engine.register_snapshot(request.snapshot_id, received, json.loads(request.adapter_config_json),
                                      persisted, request.model_id).result(_RESULT_TIMEOUT_S)
        seconds = time.perf_counter() - t0
        metrics.RECEIVE_SECONDS.observe(seconds)
        log.info("snapshot %s: %d tensors in %.1f ms (%s%sreceive %.1f, register %.1f)", request.snapshot_id,
                 len(received), 1e3 * seconds, request.transport or request.rendezvous.backend,
                 " join + " if request.rendezvous.join or request.shared.join else " ",
                 1e3 * (t_received - t0), 1e3 * (time.perf_counter() - t_received))
        return sampler_pb2.SnapshotInfo(snapshot_id=request.snapshot_id,
                                        num_bytes=sum(request.chunk_num_bytes), receive_seconds=seconds)

    def _layout_of_new(self, request) -> list:
        """The manifest's layout, checked before the bytes move: a snapshot id this replica
        already serves is refused."""
        try:
            self.engine.snapshot(request.snapshot_id)
        except NotFoundError:
            return convert.tensor_specs(request)
        raise UserError(f"snapshot {request.snapshot_id!r} already exists; snapshots are immutable")
