"""Merged serving of hot snapshots: W + scale * B @ A in a second vLLM engine.

Sampling through a LoRA snapshot costs the LoRA ops on every token; the base model without them
is much faster. So a snapshot that most sample requests use (in RL: the policy's newest) is served
from merged weights in a "merged slot": a vLLM engine without LoRA, created the first time a
snapshot is promoted (no cost while nothing is), whose weights are the base checkpoint with the
snapshot's deltas added to the target modules. The long tail stays on the multi-LoRA engine.

Policy (PromotionPolicy, settings in settings.py): over the last `merge_window` sample requests,
a snapshot whose requests asked for at least `merge_share` of the tokens (prompt + samples),
with at least `merge_min_requests` requests in the window, is promoted into a free slot, or in
place of a merged snapshot that now has a smaller share; a merged snapshot whose share falls under
half of `merge_share` is demoted (its requests go back to the LoRA engine). `merged_slots` caps
the slots; 0 turns merged serving off.

Succession: a training run's snapshots follow each other, and RL samples each new one right after
saving it, all of a step's requests at once: by the time a window could see the new snapshot get
hot, every request was admitted to the LoRA engine (an RL loop's sampler logged "0 requests
served merged" at each re-merge). So a snapshot that arrives from the run (WeightManifest.model_id)
whose snapshot a slot holds takes that slot at once, and the run's requests in the window count as
its own. A request for a snapshot a slot is promised to but does not serve yet waits for the swap
(up to `merge_wait_s`, then it runs through LoRA): an RL step's rollouts wait a few seconds for
the merge and skip several times that of LoRA ops (docs/benchmarks.md#in-the-sampler).

Consistency: the engine thread (engine.py) routes each request when it admits it, and a slot is
re-merged only once it has drained: from the moment a re-merge is asked for, the slot takes no
new request for the snapshot it served (they go to the LoRA engine, which holds every snapshot),
and the weights are swapped when its last in-flight request has finished. No request ever sees a
half-merged model.

Cost (docs/benchmarks.md#in-the-sampler): the first promotion creates the slot's engine on the
engine thread, which serves nothing meanwhile (vLLM must not build one engine while another
steps); a re-merge's weight swap runs on the engine thread too (reading the base checkpoint and
adding the deltas runs on the merger thread while both engines keep serving); a slot holds its
own weights, an untied lm_head and its 1 GiB KV cache. All engines of a replica take turns on one thread, so a slot adds
no parallelism: it pays by skipping the LoRA ops.

Merging happens on the sampler from the adapter tensors it already received (kept for the few
newest snapshots) or from the snapshot's persisted PEFT copy: no trainer change. The base
weights are re-read from the checkpoint on each merge (the page cache keeps them), so the slot
keeps no second copy and a re-merge never accumulates rounding from an unmerge.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import glob
import json
import logging
import os
import threading
import time
from typing import Callable, Iterator, NamedTuple

import torch

from tinkerd import cores, merged_export
from tinkerd.merged_export import lora_scale

log = logging.getLogger(__name__)

_PEFT_PREFIX = "base_model.model."


class UnmergeableError(ValueError):
    """The adapter has parts a merged dense weight cannot represent (it stays on LoRA)."""


class LoraFactors(NamedTuple):
    """A module's LoRA: its delta is scale * b @ a (b: [out, rank], a: [rank, in], fp32)."""
    b: torch.Tensor
    a: torch.Tensor
    scale: float


# ---- the merged weights ---------------------------------------------------------------------------

def lora_factors(tensors: dict[str, torch.Tensor], config: dict) -> dict[str, LoraFactors]:
    """Checkpoint weight name (e.g. `model.layers.0.self_attn.q_proj.weight`) -> its (B, A, scale),
    from a PEFT adapter's tensors (`base_model.model.<module>.lora_A.weight`, ...)."""
    if config.get("use_dora"):
        raise UnmergeableError("DoRA adapters are served through LoRA only")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise UnmergeableError("adapters with per-module rank or alpha patterns are served through LoRA only")
    pairs: dict[str, dict[str, torch.Tensor]] = collections.defaultdict(dict)
    for name, tensor in tensors.items():
        module, _, kind = name.removeprefix(_PEFT_PREFIX).rpartition(".lora_")
        if kind not in ("A.weight", "B.weight"):
            raise UnmergeableError(f"adapter tensor {name!r} is not a LoRA A/B matrix")
        pairs[module][kind[0]] = tensor
    scale = lora_scale(config)
    factors = {}
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise UnmergeableError(f"adapter module {module!r} lacks its lora_A or lora_B")
        factors[f"{module}.weight"] = LoraFactors(ab["B"].float(), ab["A"].float(), scale)
    return factors


def read_adapter(path: str) -> tuple[dict[str, torch.Tensor], dict]:
    """A persisted PEFT adapter's tensors and config."""
    from safetensors.torch import load_file

    with open(os.path.join(path, "adapter_config.json")) as f:
        config = json.load(f)
    return load_file(os.path.join(path, "adapter_model.safetensors")), config


def engine_overrides(model_dir: str) -> dict:
    """How a merged slot's engine differs from the LoRA one: no LoRA, weights filled by the first
    merge (not read at start), and an output layer of its own where the base model ties it to the
    input embeddings (a delta on lm_head must not change the embeddings)."""
    overrides: dict = {"load_format": "dummy"}
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    if merged_export.tied(config):
        overrides["hf_overrides"] = {"tie_word_embeddings": False}
    return overrides


def merged_checkpoint(model_dir: str, factors: dict[str, LoraFactors], dtype: torch.dtype
                      ) -> list[tuple[str, torch.Tensor]]:
    """Every weight of the base checkpoint in `dtype`, with its LoRA delta added (in fp32, rounded
    once); for a tied model also `lm_head.weight` (the embeddings plus lm_head's delta)."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise UnmergeableError(f"{model_dir} has no safetensors checkpoint to merge into")
    pending = dict(factors)
    out: list[tuple[str, torch.Tensor]] = []
    embeddings = None
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                weight = f.get_tensor(name)
                if name == "model.embed_tokens.weight":
                    embeddings = weight
                out.append((name, _add(weight, pending.pop(name, None), dtype)))
    if "lm_head.weight" not in {name for name, _ in out}:
        if embeddings is None:
            raise UnmergeableError("the checkpoint has neither lm_head.weight nor model.embed_tokens.weight")
        out.append(("lm_head.weight", _add(embeddings, pending.pop("lm_head.weight", None), dtype)))
    if pending:
        raise UnmergeableError(f"adapter modules not in the base checkpoint: {sorted(pending)[:3]}")
    return out


def _add(weight: torch.Tensor, factors: LoraFactors | None, dtype: torch.dtype) -> torch.Tensor:
    if factors is None:
        return weight.to(dtype)
    b, a, scale = factors
    if (b.shape[0], a.shape[1]) != tuple(weight.shape):
        raise UnmergeableError(f"delta shape {(b.shape[0], a.shape[1])} does not fit weight {tuple(weight.shape)}")
    # One GEMM writing W + scale * B @ A into the fp32 copy: no delta tensor the size of W made,
    # scaled and added in passes of their own (half the time: docs/benchmarks.md#in-the-sampler).
    # (safetensors' get_tensor gives a fresh tensor: an fp32 weight may be written in place.)
    return weight.float().addmm_(b, a, alpha=scale).to(dtype)


# ---- the policy ---------------------------------------------------------------------------------

_RUNS_KEPT = 1024     # snapshots whose training run the policy remembers (a slot's holder is recent)


@dataclasses.dataclass(frozen=True)
class Decision:
    action: str          # "promote" | "demote"
    snapshot_id: str
    slot: int


class PromotionPolicy:
    """Which snapshots the merged slots serve, from the recent sample traffic (see the module
    docstring). Pure bookkeeping; thread-safe. `observe` returns what to change."""

    def __init__(self, slots: int, window: int, share: float, min_requests: int):
        if slots < 0 or window < 1 or not 0 <= share <= 1 or min_requests < 1:
            raise ValueError("merged serving: need slots >= 0, window >= 1, 0 <= share <= 1, min_requests >= 1")
        self.slots: list[str | None] = [None] * slots
        self.share, self.min_requests = share, min_requests
        self._window: collections.deque[tuple[str, int]] = collections.deque(maxlen=window)
        self._refused: set[str] = set()
        self._run_of: collections.OrderedDict[str, str] = collections.OrderedDict()   # newest snapshots' runs
        self._lock = threading.Lock()

    def observe(self, snapshot_id: str, tokens: int) -> list[Decision]:
        with self._lock:
            self._window.append((snapshot_id, tokens))
            return self._decide(snapshot_id)

    def arrived(self, snapshot_id: str, run: str) -> list[Decision]:
        """A new snapshot of training run `run` ("": unknown). Where a slot holds a snapshot of the
        same run, the new one takes it now, and the run's requests in the window become its own
        (so the next look at the traffic does not demote it for having had none yet)."""
        with self._lock:
            if not run or not self.slots:
                return []
            self._run_of[snapshot_id] = run
            while len(self._run_of) > _RUNS_KEPT:
                self._run_of.popitem(last=False)
            held = next((i for i, sid in enumerate(self.slots) if sid and self._run_of.get(sid) == run), None)
            if held is None or snapshot_id in self._refused:
                return []
            previous, self.slots[held] = self.slots[held], snapshot_id
            self._window = collections.deque(((snapshot_id if sid == previous else sid, tokens)
                                              for sid, tokens in self._window), maxlen=self._window.maxlen)
            return [Decision("demote", previous, held), Decision("promote", snapshot_id, held)]

    def holds(self, slot: int, snapshot_id: str) -> bool:
        with self._lock:
            return self.slots[slot] == snapshot_id

    def promised(self, snapshot_id: str) -> bool:
        """A slot is to serve the snapshot (it may not have its weights yet)."""
        with self._lock:
            return bool(snapshot_id) and snapshot_id in self.slots

    def refuse(self, snapshot_id: str, slot: int) -> None:
        """The snapshot cannot be merged: free its slot and never promote it again."""
        with self._lock:
            self._refused.add(snapshot_id)
            if self.slots[slot] == snapshot_id:
                self.slots[slot] = None

    def shares(self) -> dict[str, float]:
        total = sum(t for _, t in self._window) or 1
        out: dict[str, float] = collections.defaultdict(float)
        for sid, tokens in self._window:
            out[sid] += tokens / total
        return out

    def _decide(self, snapshot_id: str) -> list[Decision]:
        if not self.slots:
            return []
        shares = self.shares()
        decisions = []
        for slot, merged in enumerate(self.slots):     # traffic moved away
            if merged is not None and shares.get(merged, 0.0) < self.share / 2:
                decisions.append(Decision("demote", merged, slot))
                self.slots[slot] = None
        count = sum(1 for sid, _ in self._window if sid == snapshot_id)
        if (not snapshot_id or snapshot_id in self.slots or snapshot_id in self._refused
                or count < min(self.min_requests, self._window.maxlen) or shares[snapshot_id] < self.share):
            return decisions
        if None in self.slots:
            slot = self.slots.index(None)
        else:                                          # take the slot of the least used, if it is less used
            slot = min(range(len(self.slots)), key=lambda i: shares.get(self.slots[i], 0.0))
            if shares.get(self.slots[slot], 0.0) >= shares[snapshot_id]:
                return decisions
            decisions.append(Decision("demote", self.slots[slot], slot))
        self.slots[slot] = snapshot_id
        decisions.append(Decision("promote", snapshot_id, slot))
        return decisions


# ---- the slots ------------------------------------------------------------------------------------

@dataclasses.dataclass
class MergedSlot:
    index: int
    engine: object = None                  # vLLM LLMEngine, created on the first promotion
    serving: str | None = None             # the snapshot it answers for (None: takes no request)
    pending: tuple | None = None           # (snapshot_id, weights, future): re-merge once drained
    requests: int = 0                      # served since the last merge


class MergedServing:
    """The slots, the policy, and the merger thread that computes merged weights off the engine
    thread. The engine thread (engine.py) calls `route`, `begin_merge`, `finish_merges` and
    `demote`; anything else may call `observe` and `remember`."""

    def __init__(self, policy: PromotionPolicy, model_dir: str, dtype: torch.dtype,
                 submit: Callable[[str, tuple], concurrent.futures.Future], keep_adapters: int = 2):
        self.policy = policy
        self.model_dir = model_dir
        self.dtype = dtype
        self.slots = [MergedSlot(i) for i in range(len(policy.slots))]
        self._submit = submit               # puts an item on the engine thread's inbox
        self._recent: collections.OrderedDict[str, tuple[dict, dict]] = collections.OrderedDict()
        self._keep = keep_adapters
        self._lock = threading.Lock()
        self._work: collections.deque[tuple[Decision, str]] = collections.deque()
        self._thread: threading.Thread | None = None      # the merger, while there is work
        self._stopped = False

    @property
    def enabled(self) -> bool:
        return bool(self.slots)

    # ---- any thread ----

    def remember(self, snapshot_id: str, tensors: dict[str, torch.Tensor], config: dict) -> None:
        """A copy of the received tensors of the newest snapshots (the ones likely to get hot), so
        a merge needs no disk read; older ones merge from their persisted copy. vLLM scales the B
        matrices it is given in place (by alpha/r), so those are copied unless the scale is 1; the
        rest is shared (a copy of a 45 MB adapter costs 25-65 ms of the weight sync here)."""
        if not self.enabled:
            return
        scaled = lora_scale(config) != 1
        copy = {name: t.clone() if scaled and ".lora_B." in name else t for name, t in tensors.items()}
        with self._lock:
            self._recent[snapshot_id] = (copy, dict(config))
            while len(self._recent) > self._keep:
                self._recent.popitem(last=False)

    def observe(self, snapshot_id: str, path: str, tokens: int) -> None:
        if self.enabled:
            self._carry_out(self.policy.observe(snapshot_id, tokens), path)

    def arrived(self, snapshot_id: str, run: str, path: str) -> None:
        """A snapshot was pushed (its tensors remembered): it succeeds its run's merged one."""
        if self.enabled:
            self._carry_out(self.policy.arrived(snapshot_id, run), path)

    def _carry_out(self, decisions: list[Decision], path: str) -> None:
        with self._lock:
            if self._stopped or not decisions:
                return
            self._work.extend((decision, path) for decision in decisions)
            if self._thread is None:
                # A merger per burst of work: it ends once the work is done, and the OpenMP pool
                # its merges started ends with it (tinkerd/cores.py: one pool per process).
                self._thread = threading.Thread(target=self._merger, name="merger", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            self._work.clear()

    # ---- merger thread ----

    def _merger(self) -> None:
        while True:
            with self._lock:
                if not self._work:
                    self._thread = None
                    return
                decision, path = self._work.popleft()
            if decision.action == "promote" and not self.policy.holds(decision.slot, decision.snapshot_id):
                continue                          # superseded (its run's next snapshot took the slot)
            try:
                if decision.action == "demote":
                    self._submit("demote", (decision.slot, decision.snapshot_id)).result()
                    continue
                t0 = time.perf_counter()
                with cores.share().computing():         # requests wait for it: the host's cores help
                    weights = self._weights(decision.snapshot_id, path)
                log.info("merged weights of snapshot %s computed in %.0f ms", decision.snapshot_id,
                         1e3 * (time.perf_counter() - t0))
                self._submit("merge", (decision.slot, decision.snapshot_id, weights)).result()
            except Exception as e:  # noqa: BLE001 - the snapshot stays on LoRA serving
                log.warning("snapshot %s not merged into slot %d: %s", decision.snapshot_id, decision.slot, e)
                self.policy.refuse(decision.snapshot_id, decision.slot)

    def _weights(self, snapshot_id: str, path: str) -> list[tuple[str, torch.Tensor]]:
        with self._lock:
            kept = self._recent.get(snapshot_id)
        if kept is None:
            if not path or not os.path.isfile(os.path.join(path, "adapter_model.safetensors")):
                raise UnmergeableError("its tensors are no longer in memory and it has no persisted copy")
            kept = read_adapter(path)
        return merged_checkpoint(self.model_dir, lora_factors(*kept), self.dtype)

    # ---- engine thread ----

    def route(self, snapshot_id: str) -> MergedSlot | None:
        for slot in self.slots:
            if slot.serving == snapshot_id and slot.pending is None:
                return slot
        return None

    def begin_merge(self, index: int, snapshot_id: str, weights, future, create_engine: Callable[[], object]) -> None:
        slot = self.slots[index]
        if slot.engine is None:
            slot.engine = create_engine()
        slot.serving = None                  # new requests go to the LoRA engine from now on
        slot.pending = (snapshot_id, weights, future)

    def finish_merges(self) -> None:
        """Swap the weights of every slot that waits for it and has drained."""
        for slot in self.slots:
            if slot.pending is None or slot.engine.has_unfinished_requests():
                continue
            snapshot_id, weights, future = slot.pending
            slot.pending = None
            try:
                t0 = time.perf_counter()
                slot.engine.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights),
                                                                     "is_checkpoint_format": True})
                slot.engine.reset_prefix_cache()
            except Exception as e:  # noqa: BLE001 - the merger thread refuses the snapshot
                future.set_exception(e)
                continue
            slot.serving, slot.requests = snapshot_id, 0
            log.info("merged slot %d now serves snapshot %s (weights swapped in %.0f ms)", slot.index,
                     snapshot_id, 1e3 * (time.perf_counter() - t0))
            future.set_result(slot.index)

    def demote(self, index: int, snapshot_id: str) -> None:
        slot = self.slots[index]
        if slot.serving == snapshot_id:
            log.info("merged slot %d no longer serves snapshot %s (%d requests served merged)", index,
                     snapshot_id, slot.requests)
            slot.serving = None

    def busy(self) -> bool:
        return any(s.pending is not None for s in self.slots)

    def engines(self) -> Iterator:
        return (s.engine for s in self.slots if s.engine is not None)
