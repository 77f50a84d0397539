"""SamplerEngine: one vLLM engine serving the base model and immutable LoRA snapshots.

One thread owns the engine and runs a continuous-batching loop: it admits new requests and
snapshot registrations from an inbox between engine steps, so requests from many callers share
batches, and a registration never races a step. Callers get concurrent.futures.Future results.

Snapshots: each arrives as in-memory tensors, gets a fresh LoRA int id, and is registered in
the worker's adapter cache without touching disk. Its persisted copy (written by the trainer
during the push) is the path vLLM reloads from if the cache ever evicts it.

Hot snapshots are served from merged weights in further engines (merged.py): the same thread
steps them in turn, since vLLM keeps its forward context in process-global state (two engines
of one process must never run a step at the same time), and it routes each request when it
admits it, so a slot's weight swap (done there, once the slot has drained) never races a step;
a request for a snapshot whose merged weights are on their way waits for them there ("parked").

No gRPC here.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import os
import queue
import threading
import time
import uuid

import torch

from sampler_service import metrics
from sampler_service.merged import MergedServing, PromotionPolicy, engine_overrides
from sampler_service.settings import ALONE_GPU_MEMORY_UTILIZATION
from tinkerd import cores, hardware
from tinkerd.errors import NotFoundError, UserError

log = logging.getLogger(__name__)

# A LoRARequest needs a non-empty path even when the adapter is already resident.
_NO_PATH = "/nonexistent/tinkerd-snapshot-without-persisted-copy"


@dataclasses.dataclass(frozen=True)
class Snapshot:
    snapshot_id: str
    lora_int_id: int
    path: str


@dataclasses.dataclass
class _Pending:
    kind: str                 # "generate" | "abort" | "register" | "merge" | "demote" | "stop"
    payload: tuple
    future: concurrent.futures.Future


@dataclasses.dataclass(frozen=True)
class MergedSettings:
    """See merged.py for the policy; slots 0 turns merged serving off."""
    slots: int = 0
    window: int = 32
    share: float = 0.5
    min_requests: int = 4
    wait_s: float = 20.0      # a request for a snapshot a slot is promised to waits this long for it

    def __post_init__(self):
        if not self.wait_s >= 0:
            raise UserError(f"--merge-wait-s must be 0 (never wait) or a number of seconds, got {self.wait_s}")


# How often the engine thread looks at its parked requests while it has nothing else to do.
_PARKED_POLL_S = 0.02


# vLLM's CPU backend pages its KV cache in 128-token blocks unless told otherwise, and caches
# prefixes in whole blocks: an RL group's 8 samples of a 35-token prompt shared nothing. 32 (the
# smallest its CPU attention takes) lets them share, and long prompts lose nothing
# (docs/benchmarks.md#in-the-sampler).
CPU_KV_BLOCK_TOKENS = 32


def engine_args(model_dir: str, *, dtype: str = "auto", max_model_len: int = 0, max_num_seqs: int = 64,
                tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.0, kv_cache_mib: int = 0,
                kv_block_tokens: int = 0, seed: int = 0) -> dict:
    """vLLM EngineArgs of every engine of a replica (LoRA and merged ones); LoRA options aside.
    `kv_block_tokens` 0: CPU_KV_BLOCK_TOKENS on CPU, vLLM's own choice on a GPU;
    `gpu_memory_utilization` 0: vLLM's 0.9 (an engine with its GPU to itself);
    `max_model_len` 0: the model's context, cut to what the KV cache holds (vLLM's -1)."""
    if max_model_len < 0:
        raise UserError(f"--max-model-len must be 0 (the model's own context) or a number of tokens, "
                        f"got {max_model_len}")
    if not 0 <= gpu_memory_utilization <= 1:
        raise UserError(f"--gpu-memory-utilization must be a share of the GPU's memory, above 0 and at most 1 "
                        f"(0: the default), got {gpu_memory_utilization:g}")
    gpu_memory_utilization = gpu_memory_utilization or ALONE_GPU_MEMORY_UTILIZATION
    args = dict(model=model_dir, dtype=dtype, enforce_eager=True, max_model_len=max_model_len or -1, seed=seed,
                max_num_seqs=max_num_seqs, tensor_parallel_size=tensor_parallel_size,
                gpu_memory_utilization=gpu_memory_utilization)
    if kv_block_tokens < 0:
        raise UserError(f"--kv-block-tokens must be 0 (the default) or a block size, got {kv_block_tokens}")
    gpu = hardware.has_gpu()
    block = kv_block_tokens or (0 if gpu else CPU_KV_BLOCK_TOKENS)
    if block:
        args["block_size"] = block
    if not gpu:
        from sampler_service import cpu_norms
        if priority := cpu_norms.ir_op_priority():
            args["ir_op_priority"] = priority
    if kv_cache_mib < 0:
        raise UserError(f"--kv-cache-mib must be 0 (the default size) or a size in MiB, got {kv_cache_mib}")
    if kv_cache_mib:
        args["kv_cache_memory_bytes"] = kv_cache_mib << 20
    return args


def size_cpu_kv_cache(kv_cache_mib: int) -> None:
    """On CPU, vLLM sizes the KV cache from VLLM_CPU_KVCACHE_SPACE (whole GiB) over the engine
    argument when the variable is set: an explicit --kv-cache-mib must win, and without one the
    cache is 1 GiB unless the variable says otherwise."""
    if kv_cache_mib:
        if os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None) is not None:
            log.info("--kv-cache-mib %d is used instead of VLLM_CPU_KVCACHE_SPACE", kv_cache_mib)
    else:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def check_parallelism(tensor_parallel_size: int, gpu_count: int) -> None:
    """Refuses, at start-up, a tensor-parallel size this machine should not run. On CPU, vLLM
    0.32 runs each rank as a worker process bound to a NUMA node of its own, and stops deep in its
    start-up on a machine with fewer nodes than ranks unless VLLM_CPU_OMP_THREADS_BIND binds cores
    by hand; bound by hand, 2 ranks of the tiny model took seconds for a few tokens
    (docs/benchmarks.md#in-the-sampler), and tinkerd's LoRA registration (in-process tensors,
    worker_ext.py) is not verified across worker processes. A CPU pool scales with replicas
    instead. On a GPU the replica needs that many GPUs visible."""
    if tensor_parallel_size < 1:
        raise UserError(f"--tensor-parallel-size must be at least 1, got {tensor_parallel_size}")
    if tensor_parallel_size > 1 and gpu_count == 0:
        raise UserError(f"--tensor-parallel-size {tensor_parallel_size} needs GPUs; on CPU a replica runs with "
                        f"1 (vLLM's CPU backend wants a NUMA node per rank, and gains nothing over replicas: "
                        f"scale a CPU pool with more of them, tinkerd up --sampler-replicas N or more "
                        f"`tinkerd sampler --register-with` processes)")
    if tensor_parallel_size > gpu_count > 0:
        raise UserError(f"--tensor-parallel-size {tensor_parallel_size} needs that many GPUs; this replica sees "
                        f"{gpu_count} (CUDA_VISIBLE_DEVICES, or the pod's nvidia.com/gpu limit)")


class SamplerEngine:
    def __init__(self, model_dir: str, *, dtype: str = "auto", max_model_len: int = 0,
                 max_loras: int = 4, max_cpu_loras: int = 64, max_lora_rank: int = 64,
                 max_num_seqs: int = 64, tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.0,
                 kv_cache_mib: int = 0, kv_block_tokens: int = 0, seed: int = 0,
                 merged: MergedSettings = MergedSettings()):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        size_cpu_kv_cache(kv_cache_mib)

        self.model_dir = model_dir
        self._engine_args = engine_args(model_dir, dtype=dtype, max_model_len=max_model_len,
                                        max_num_seqs=max_num_seqs, tensor_parallel_size=tensor_parallel_size,
                                        gpu_memory_utilization=gpu_memory_utilization, kv_cache_mib=kv_cache_mib,
                                        kv_block_tokens=kv_block_tokens, seed=seed)
        self._engine = self._new_engine(
            enable_lora=True, max_loras=max_loras, max_cpu_loras=max_cpu_loras, max_lora_rank=max_lora_rank)
        self._engine.collective_rpc("tinkerd_install_lora_fixes")   # see worker_ext.py
        # What vLLM took (with 0: the model's context, or what its KV cache holds); the merged
        # slots' engines take the same, so a request never moves to an engine it does not fit.
        self.max_model_len = self._engine_args["max_model_len"] = self._engine.model_config.max_model_len
        log.info("context length: %d tokens (prompt + max_tokens)%s", self.max_model_len,
                 "" if max_model_len else " (--max-model-len 0: the model's own, or what the KV cache holds)")
        self.vocab_size = self._engine.model_config.get_vocab_size()
        tokenizer = self._engine.get_tokenizer()
        self.eos_token_id = tokenizer.eos_token_id
        self._snapshots: dict[str, Snapshot] = {}
        self._registry_lock = threading.Lock()
        self._lora_ids = itertools.count(1)
        self._inbox: queue.Queue[_Pending] = queue.Queue()
        self._waiting: dict[str, tuple[concurrent.futures.Future, int, list]] = {}
        self._group_engine: dict[str, object] = {}     # request group -> the engine running it
        self._parked: list[tuple[_Pending, float]] = []  # generate items waiting for a merged slot
        self._merge_wait_s = merged.wait_s
        self.merged = MergedServing(
            PromotionPolicy(merged.slots, merged.window, merged.share, merged.min_requests), model_dir,
            self._engine.model_config.dtype, self._submit)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="vllm-engine", daemon=True)
        self._thread.start()

    def _new_engine(self, **kwargs):
        """An engine of this replica (the LoRA one, or a merged slot's): each computes the base
        model alike, so a snapshot's logprobs do not move as it is promoted (worker_ext.py)."""
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        engine = LLMEngine.from_engine_args(EngineArgs(
            **self._engine_args, **kwargs, worker_extension_cls="sampler_service.worker_ext.SnapshotWorkerExtension"))
        engine.collective_rpc("tinkerd_install_cpu_fixes")
        # Whether its workers score prompt target ids (target_prompt_logprobs) in the prefill.
        self.scores_prompt_targets = all(engine.collective_rpc("tinkerd_install_prompt_scoring"))
        return engine

    def _new_merged_engine(self):
        """A merged slot's engine (engine thread only: it must not be built while another steps)."""
        import time

        t0 = time.perf_counter()
        engine = self._new_engine(**engine_overrides(self.model_dir))
        log.info("merged-slot engine created in %.1f s", time.perf_counter() - t0)
        return engine

    # ---- public API (any thread) ----------------------------------------------------------

    def snapshot(self, snapshot_id: str, path: str = "") -> Snapshot | None:
        """The snapshot; one this replica never received is registered from its persisted copy
        at `path` (vLLM loads it on first use), so a restarted or new replica still serves it.
        The caller waits for a copy still being written (servicer.py), so a path without an
        adapter here is an error."""
        if not snapshot_id:
            return None
        with self._registry_lock:
            snap = self._snapshots.get(snapshot_id)
            if snap is None and path and os.path.isfile(os.path.join(path, "adapter_config.json")):
                snap = self._snapshots[snapshot_id] = Snapshot(snapshot_id, next(self._lora_ids), path)
                log.info("snapshot %s registered from its persisted copy %s", snapshot_id, path)
                metrics.SNAPSHOT_LOADS.labels("disk").inc()
        if snap is None:
            raise NotFoundError(f"unknown snapshot {snapshot_id!r}: it was never pushed to this sampler"
                                + (f" and {path} holds no adapter" if path else ""))
        return snap

    def generate(self, prompt_tokens: list[int], params, num_samples: int,
                 snapshot_id: str = "", snapshot_path: str = "", cache_namespace: str = "") -> concurrent.futures.Future:
        """Future of a list of `num_samples` vLLM RequestOutputs (one sequence each). A
        `cache_namespace` keeps its prefix-cache entries apart from every other namespace's."""
        self._check_prompt(prompt_tokens, params.max_tokens)
        snap = self.snapshot(snapshot_id, snapshot_path)
        self.merged.observe(snap.snapshot_id if snap else "", snapshot_path or (snap.path if snap else ""),
                            len(prompt_tokens) + num_samples * params.max_tokens)
        future: concurrent.futures.Future = concurrent.futures.Future()
        metrics.track_sample(future, len(prompt_tokens))
        self._inbox.put(_Pending("generate", (prompt_tokens, params, num_samples, snap, cache_namespace), future))
        return future

    def abort(self, future: concurrent.futures.Future) -> None:
        """Stops the generation behind `future` (from generate) at the next step, freeing its
        batch slots: its caller went away. The future ends cancelled; a finished one is left."""
        if not future.done():
            self._inbox.put(_Pending("abort", (future,), concurrent.futures.Future()))

    def register_snapshot(self, snapshot_id: str, tensors: dict[str, torch.Tensor], adapter_config: dict,
                          path: str, run: str = "") -> concurrent.futures.Future:
        """`run`: the training run it is a snapshot of ("" if unknown), for merged serving's succession."""
        if snapshot_id in self._snapshots:
            raise UserError(f"snapshot {snapshot_id!r} already exists; snapshots are immutable")
        self.merged.remember(snapshot_id, tensors, adapter_config)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(_Pending("register", (snapshot_id, tensors, adapter_config, path, run), future))
        return future

    def num_snapshots(self) -> int:
        return len(self._snapshots)

    def served_by(self, snapshot_id: str) -> str:
        """"merged" or "lora": where a request for the snapshot admitted now would run."""
        return "merged" if self.merged.route(snapshot_id) is not None else "lora"

    def shutdown(self) -> None:
        self.merged.stop()
        self._stopped.set()
        self._inbox.put(_Pending("stop", (), concurrent.futures.Future()))
        self._thread.join(timeout=10)

    def _submit(self, kind: str, payload: tuple) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(_Pending(kind, payload, future))
        return future

    def _check_prompt(self, tokens: list[int], max_tokens: int) -> None:
        if not tokens:
            raise UserError("the prompt is empty")
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise UserError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if len(tokens) + max_tokens > self.max_model_len:
            raise UserError(f"prompt ({len(tokens)} tokens) + max_tokens ({max_tokens}) exceeds the "
                            f"context length {self.max_model_len}")

    # ---- engine thread --------------------------------------------------------------------

    def _engines(self) -> list:
        return [self._engine, *self.merged.engines()]

    def _loop(self) -> None:
        while not self._stopped.is_set():
            share = cores.share()                  # (a service configures it once; read where used)
            busy = any(e.has_unfinished_requests() for e in self._engines()) or self.merged.busy()
            try:
                if busy:
                    item = self._inbox.get_nowait()
                else:
                    share.idle()                   # the host's cores go to whoever computes
                    item = self._inbox.get(timeout=_PARKED_POLL_S if self._parked else None)
            except queue.Empty:
                item = None
            while item is not None:
                self._admit(item)
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    item = None
            self.merged.finish_merges()            # slots that drained get their new weights
            self._release_parked()
            for engine in self._engines():
                if engine.has_unfinished_requests():
                    share.busy()                   # threads for this step: the host's cores / busy services
                    try:
                        with metrics.ENGINE_STEP_SECONDS.time():
                            outputs = engine.step()
                        self._deliver(outputs)
                    except Exception as e:  # noqa: BLE001 - fail the in-flight requests, keep serving
                        log.exception("engine step failed")
                        self._fail_all(engine, e)

    def _admit(self, item: _Pending) -> None:
        if item.kind == "stop":
            return
        try:
            if item.kind == "register":
                self._register(item)
            elif item.kind == "merge":
                slot, snapshot_id, weights = item.payload
                self.merged.begin_merge(slot, snapshot_id, weights, item.future, self._new_merged_engine)
            elif item.kind == "demote":
                self.merged.demote(*item.payload)
                item.future.set_result(None)
            elif item.kind == "abort":
                self._abort(*item.payload)
            else:
                self._add_generate(item)
        except Exception as e:  # noqa: BLE001 - the caller gets the error
            if not item.future.done():
                item.future.set_exception(e)

    def _register(self, item: _Pending) -> None:
        snapshot_id, tensors, adapter_config, path, run = item.payload
        lora_id = next(self._lora_ids)
        self._engine.collective_rpc("tinkerd_add_lora_tensors", args=(lora_id, tensors, adapter_config))
        snap = Snapshot(snapshot_id, lora_id, path or _NO_PATH)
        with self._registry_lock:
            self._snapshots[snapshot_id] = snap
        metrics.SNAPSHOT_LOADS.labels("stream").inc()
        # Before the reply, so the first request for it (admitted after this) finds its slot promised.
        self.merged.arrived(snapshot_id, run, path)
        item.future.set_result(snap)

    def _add_generate(self, item: _Pending) -> None:
        snap = item.payload[3]
        slot = self.merged.route(snap.snapshot_id) if snap else None
        if snap and self._waits(snap.snapshot_id, slot, 0.0):
            self._parked.append((item, time.monotonic()))      # its merged weights are on their way
            return
        self._start(item, slot)

    def _waits(self, snapshot_id: str, slot, waited: float) -> bool:
        """A request for the snapshot waits for its merged weights: a slot is promised to it but
        does not serve it yet, and it has waited less than `merge_wait_s`."""
        return slot is None and waited < self._merge_wait_s and self.merged.policy.promised(snapshot_id)

    def _release_parked(self) -> None:
        """Parked requests go to their slot once it serves their snapshot, or through LoRA when no
        slot is promised to it any more (refused, demoted) or they waited `merge_wait_s`."""
        if not self._parked:
            return
        now, waiting = time.monotonic(), []
        released: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
        for item, since in self._parked:
            snapshot_id = item.payload[3].snapshot_id
            slot = self.merged.route(snapshot_id)
            if self._waits(snapshot_id, slot, now - since):
                waiting.append((item, since))
                continue
            self._start(item, slot)
            metrics.MERGE_WAIT_SECONDS.observe(now - since)
            released[(snapshot_id, "through LoRA" if slot is None else "merged")].append(now - since)
        self._parked = waiting
        for (snapshot_id, where), waits in released.items():
            log.info("%d requests for snapshot %s waited up to %.1f s for its merged slot, now run %s",
                     len(waits), snapshot_id, max(waits), where)

    def _start(self, item: _Pending, slot) -> None:
        from vllm.lora.request import LoRARequest

        prompt_tokens, params, num_samples, snap, cache_namespace = item.payload
        prompt = {"prompt_token_ids": prompt_tokens}
        if cache_namespace:
            prompt["cache_salt"] = cache_namespace
        if slot is not None:                 # a hot snapshot: its merged weights, no LoRA
            engine, lora = slot.engine, None
            slot.requests += 1
        else:
            engine = self._engine
            lora = LoRARequest(snap.snapshot_id, snap.lora_int_id, snap.path) if snap else None
        metrics.REQUESTS.labels("merged" if slot is not None else "lora" if snap else "base").inc()
        group = uuid.uuid4().hex
        results: list = [None] * num_samples
        self._waiting[group] = (item.future, num_samples, results)
        self._group_engine[group] = engine
        for i in range(num_samples):
            p = params
            if i > 0 and (params.seed is not None or params.extra_args):
                p = params.clone()
                if params.seed is not None:
                    p.seed = params.seed + i  # distinct but reproducible samples
                if params.extra_args:
                    # The reply reads prompt targets from the first sample: the others need
                    # not score them, and may read the prompt from the prefix cache.
                    p.extra_args, p.skip_reading_prefix_cache = None, params.prompt_logprobs is not None
            engine.add_request(f"{group}-{i}", prompt, p, lora_request=lora)

    def _abort(self, future: concurrent.futures.Future) -> None:
        """The group behind `future` out of its engine (generate's item came through the inbox
        first, so it is admitted by now, or already finished)."""
        parked = next((i for i, (item, _) in enumerate(self._parked) if item.future is future), None)
        if parked is not None:
            del self._parked[parked]
            future.cancel()
            return
        group = next((g for g, (f, _, _) in self._waiting.items() if f is future), None)
        if group is None:
            return
        _, _, results = self._waiting.pop(group)
        engine = self._group_engine.pop(group)
        engine.abort_request([f"{group}-{i}" for i in range(len(results))])
        future.cancel()
        log.info("aborted request group %s (%d sequences): its caller went away", group, len(results))

    def _deliver(self, outputs) -> None:
        for out in outputs:
            if not out.finished:
                continue
            group, index = out.request_id.rsplit("-", 1)
            if group not in self._waiting:        # aborted (see _abort)
                continue
            future, remaining, results = self._waiting[group]
            results[int(index)] = out
            remaining -= 1
            if remaining == 0:
                del self._waiting[group]
                del self._group_engine[group]
                future.set_result(results)
            else:
                self._waiting[group] = (future, remaining, results)

    def _fail_all(self, engine, error: Exception) -> None:
        for group, (future, _, results) in list(self._waiting.items()):
            if self._group_engine[group] is not engine:
                continue
            engine.abort_request([f"{group}-{i}" for i in range(len(results))])
            future.set_exception(error)
            del self._waiting[group], self._group_engine[group]
