"""Tinker's training calls on a model's DeepSpeed engine.

Every forward_backward is a micro-step *inside* a gradient-accumulation window (the boundary is
held open), so gradients add up across calls; optim_step closes the window, steps, and opens a
new one. Losses are sums, so DeepSpeed's 1/GAS scaling is turned off.

How optim_step closes the window depends on the ZeRO stage:
- stage 0 (what ZeRO-1/2 run as on one rank): the gradients are plain .grad. Several ranks
  all-reduce them explicitly; then the total norm is taken and clipped here (DeepSpeed's
  clip_grad is a ZeRO optimizer's), and the adapter's optimizer (AdamW or Dimuon) steps.
- stages 1-3: a 1-token zero-loss micro-step at the boundary triggers ZeRO's reduction, and
  the ZeRO optimizer clips and reports the norm.

forward_backward copies its outputs to the host once per call: no per-datum synchronization.
The caller (TrainerEngine) holds the engine lock around forward_backward and optim_step.
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import itertools
import math

import torch

from tinkerd.adam import ADAM_MAX
from tinkerd.optimizers import DIMUON_MAX
from tinkerd.errors import UserError
from trainer_service import prefix_tree
from trainer_service.custom_loss import CompiledLoss
from trainer_service.logprobs import DEFAULT_MAX_LOGITS_BYTES
from trainer_service.losses import ELEMENTWISE
from trainer_service.registry import LoraModel
from trainer_service.settings import TrainerSettings


MAX_BATCH_TOKENS = TrainerSettings.max_batch_tokens


@dataclasses.dataclass
class DatumInput:
    tokens: list[int]
    loss_fn_inputs: dict[str, torch.Tensor]


@dataclasses.dataclass
class AdamParams:
    """Every field given: the API's defaults are applied where requests arrive (gateway/protocol.py)."""
    learning_rate: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_clip_norm: float  # 0: no clipping


@dataclasses.dataclass
class DimuonParams:
    """Every field given, as AdamParams (dimuon.py says what each does)."""
    learning_rate: float
    beta1: float
    damping: float
    rank_lr_correction_exponent: float
    grad_clip_norm: float  # 0: no clipping


OptimParams = AdamParams | DimuonParams


def validate(data: list[DatumInput], *, vocab_size: int, max_positions: int, max_batch_tokens: int,
             scalar_keys: frozenset[str] = frozenset()) -> None:
    """`scalar_keys`: loss inputs of one value per datum (a custom loss's rank-0 inputs), not per token."""
    if not data:
        raise UserError("forward_backward needs at least one datum")
    longest = max(len(d.tokens) for d in data)
    if len(data) * longest > max_batch_tokens:     # every datum is padded to the longest
        raise UserError(f"{len(data)} datums padded to the longest ({longest} tokens) make {len(data) * longest} "
                        f"tokens, over this trainer's --max-batch-tokens {max_batch_tokens}: send fewer datums "
                        f"per request, or group them by length")
    for i, d in enumerate(data):
        n = len(d.tokens)
        if n == 0:
            raise UserError(f"datum {i}: model_input is empty")
        if n > max_positions:
            raise UserError(f"datum {i}: {n} tokens exceed the model's context of {max_positions}")
        if min(d.tokens) < 0 or max(d.tokens) >= vocab_size:      # C loops; the culprit found after
            bad = next(t for t in d.tokens if not 0 <= t < vocab_size)
            raise UserError(f"datum {i}: token id {bad} is outside the vocabulary [0, {vocab_size})")
        for key, t in d.loss_fn_inputs.items():
            if key in scalar_keys:
                continue
            if t.dim() == 0 or t.shape[0] != n:
                raise UserError(f"datum {i}: loss_fn_inputs[{key!r}] has shape {list(t.shape)}, "
                                f"expected leading dimension {n} (the number of input tokens)")
        targets = d.loss_fn_inputs.get("target_tokens")
        if targets is None:
            raise UserError(f"datum {i}: loss_fn_inputs needs 'target_tokens'")
        if targets.dim() != 1:
            raise UserError(f"datum {i}: target_tokens must be 1-D, got shape {list(targets.shape)}")
        if targets.is_floating_point() or targets.is_complex():
            raise UserError(f"datum {i}: target_tokens must be integers, got {targets.dtype}")
    low, high = torch.aminmax(torch.cat([d.loss_fn_inputs["target_tokens"] for d in data]))   # one check for the batch
    if low < 0 or high >= vocab_size:
        for i, d in enumerate(data):        # which datum, for the message
            t = d.loss_fn_inputs["target_tokens"]
            if ((t < 0) | (t >= vocab_size)).any():
                raise UserError(f"datum {i}: a target token is outside the vocabulary [0, {vocab_size})")


IGNORED = -100      # cross_entropy's ignore_index: padding positions


@dataclasses.dataclass
class _Batch:
    lengths: list[int]                  # each datum's tokens
    ids: torch.Tensor                   # [datums, longest], right-padded; or [rows, longest row], packed
    mask: torch.Tensor | None           # None where nothing is padded; 4-D where packed
    how: dict[str, torch.Tensor]        # logprobs.token_logprobs' targets and where they are


def _batch(data: list[DatumInput], device: torch.device, packable: bool = False) -> _Batch:
    """The batch, built on the host in a few ops whatever the number of datums. No mask where
    nothing is padded: attention is then plainly causal, which transformers would otherwise find
    out by reading the mask back from the device (a synchronization). `packable`: datums that
    share prefixes (an RL batch's rollouts of one prompt) may go as token trees (prefix_tree.py)."""
    lengths = [len(d.tokens) for d in data]
    longest = max(lengths)
    targets = torch.cat([d.loss_fn_inputs["target_tokens"] for d in data]).long()
    packed = prefix_tree.pack([list(d.tokens) for d in data], targets) if packable and len(data) > 1 else None
    if packed is not None:
        return _Batch(lengths, _to_device(packed.ids, device), _to_device(packed.mask, device),
                      {"targets": _to_device(packed.targets, device), "real": _to_device(packed.unembed, device),
                       "position_ids": _to_device(packed.positions, device),
                       "expand": _to_device(packed.expand, device),
                       "paths": [_to_device(group, device) for group in packed.paths]})
    if min(lengths) == longest:
        ids = _ids(itertools.chain.from_iterable(d.tokens for d in data)).view(len(data), longest)
        return _Batch(lengths, _to_device(ids, device), None,
                      {"targets": _to_device(targets.view(len(data), longest), device)})
    ids = _ids(itertools.chain.from_iterable(itertools.chain(d.tokens, itertools.repeat(0, longest - n))
                                             for d, n in zip(data, lengths))).view(len(data), longest)
    mask = (torch.arange(longest) < torch.tensor(lengths).unsqueeze(1)).long()
    real = mask.view(-1).nonzero().squeeze(1)
    padded_targets = torch.full((len(data) * longest,), IGNORED, dtype=torch.long).index_copy(0, real, targets)
    return _Batch(lengths, _to_device(ids, device), _to_device(mask, device),
                  {"targets": _to_device(padded_targets.view(len(data), longest), device),
                   "real": _to_device(real, device)})


def _ids(tokens) -> torch.Tensor:
    """Token ids as a flat int64 tensor, by way of an array: torch.tensor over Python lists
    converts int by int (~75 us for 4 x 64 tokens, a twentieth of that this way)."""
    return torch.frombuffer(array.array("q", tokens), dtype=torch.long)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on the device, without making the host wait on a GPU: a copy from pageable
    memory synchronizes (it waits for every op queued before it, so a copy made after the forward
    was queued idled the GPU while the host queued the backward); one from pinned memory is
    queued like any op (the pinned block is not reused before the copy is done)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _on_device(inputs: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: _to_device(v.float() if v.is_floating_point() else v, device) for k, v in inputs.items()}


def _joined_inputs(data: list[DatumInput], device: torch.device) -> dict[str, torch.Tensor] | None:
    """Every datum's loss inputs on the device (floats as float32), each key one tensor over the
    batch's tokens in datum order: when the datums agree on keys, dtypes and per-token shapes and
    every input is per token (a custom loss's rank-0 input is one value per datum); else None."""
    first = data[0].loss_fn_inputs
    form = {k: (v.dtype, v.shape[1:]) for k, v in first.items()}
    per_token = all(v.dim() > 0 and v.shape[0] == len(d.tokens) for d in data for v in d.loss_fn_inputs.values())
    if not per_token or any({k: (v.dtype, v.shape[1:]) for k, v in d.loss_fn_inputs.items()} != form for d in data):
        return None
    return _on_device({k: torch.cat([d.loss_fn_inputs[k] for d in data]) for k in first}, device)


def _inputs_on_device(data: list[DatumInput], lengths: list[int], joined: dict[str, torch.Tensor] | None,
                      device: torch.device) -> list[dict[str, torch.Tensor]]:
    """Every datum's loss inputs on the device: views of `joined`, else one copy per datum."""
    if joined is None:
        return [_on_device(d.loss_fn_inputs, device) for d in data]
    split = {k: v.split(lengths) for k, v in joined.items()}
    return [{k: split[k][i] for k in joined} for i in range(len(data))]


def _to_host(logprobs: list[torch.Tensor], losses: list[torch.Tensor],
             scalars: torch.Tensor) -> tuple[list[dict[str, torch.Tensor]], list[float]]:
    """Per-datum outputs and the 1-D `scalars` (the loss sum first), in one device-to-host copy."""
    lengths = [len(t) for t in logprobs]
    flat = torch.cat([*logprobs, *losses, scalars.reshape(-1)]).detach().float().cpu()
    parts = flat.split([*lengths, *lengths, scalars.numel()])
    n = len(lengths)
    return [{"logprobs": parts[i], "elementwise_loss": parts[n + i]} for i in range(n)], parts[-1].tolist()


def _custom_losses(loss: CompiledLoss, logprobs: list[torch.Tensor], inputs: list[dict[str, torch.Tensor]]):
    """A server-side custom loss, as forward_backward_custom computes it on the client, in one pass:
    per datum, the loss of detached logprobs and its gradient g = dloss/dlogprobs; the model then
    backpropagates sum(logprobs * g) (the client's second call: cross_entropy with weights -g),
    whose gradient is the loss's. Returns the per-token surrogate (the client's elementwise_loss),
    its total, and the scalars [loss sum, surrogate sum, metrics...] (":mean" metrics summed here,
    divided by the batch's datums once the ranks' sums are in: engine.py)."""
    per_token, values, metric_sums = [], [], {k: [] for k in loss.metric_keys}
    for lp, datum_inputs in zip(logprobs, inputs):
        leaf = lp.detach().requires_grad_(True)
        with torch.enable_grad():
            value, metrics = loss.run(loss.arguments(leaf, datum_inputs))
            if value.requires_grad:
                grad, = torch.autograd.grad(value, leaf, allow_unused=True)
            else:
                grad = None
        grad = torch.zeros_like(leaf) if grad is None else grad.to(lp.dtype)
        per_token.append(lp * grad)
        values.append(value.detach().float())
        for key, metric in metrics.items():
            metric_sums[key].append(metric.detach().float().reshape(()))
    total = logprobs[0].new_zeros((), dtype=torch.float32)
    for term in per_token:     # summed datum by datum, in order, as always
        total = total + term.sum()
    scalars = torch.stack([torch.stack(values).sum(), total.detach(),
                           *(torch.stack(metric_sums[k]).sum() for k in loss.metric_keys)])
    return per_token, total, scalars


def custom_metric_names(loss: CompiledLoss) -> list[str]:
    """The metrics of a custom loss's forward_backward, in the order of its scalars."""
    return ["loss:sum", "surrogate_loss:sum", *loss.metric_keys]


def forward_backward(model: LoraModel, data: list[DatumInput], loss_impl, loss_fn_config: dict[str, float], *,
                     forward_only: bool, device: torch.device, ranks: int = 1, zero_stage: int = 0,
                     max_logits_bytes: int = DEFAULT_MAX_LOGITS_BYTES, groups: list[list[int]] | None = None,
                     steps: int = 1, packable: bool = False):
    """Returns (per-datum outputs, metrics). Gradients accumulate until optim_step.
    `groups`: the micro-batches (indices into `data`; default all in one, microbatches.py), each
    through forward and backward in turn; `steps`: the micro-steps every rank takes (the most
    groups of any rank's share), a share with fewer taking empty ones, so that ZeRO's collectives
    pair up. With `ranks` > 1, `data` is this rank's share of the batch (ranks.py): DeepSpeed
    averages gradients over ranks and the loss is a sum, so this rank's part is scaled by `ranks`.
    `max_logits_bytes`: the fp32 logits held at once (logprobs.py). `packable`: the model allows
    datums that share prefixes to go as token trees (prefix_tree.py)."""
    custom = isinstance(loss_impl, CompiledLoss)
    names = custom_metric_names(loss_impl) if custom else ["loss:sum"]
    if groups is None:
        groups = [list(range(len(data)))] if data else []
    logprobs: list[torch.Tensor | None] = [None] * len(data)
    losses: list[torch.Tensor | None] = [None] * len(data)
    scalars = []
    for group in groups:
        group_logprobs, group_losses, group_scalars = _micro_step(
            model, [data[i] for i in group], loss_impl, loss_fn_config, forward_only=forward_only, device=device,
            ranks=ranks, zero_stage=zero_stage, max_logits_bytes=max_logits_bytes, packable=packable)
        for i, lp, loss in zip(group, group_logprobs, group_losses):
            logprobs[i], losses[i] = lp, loss
        scalars.append(group_scalars)
    for _ in range(steps - len(groups)):     # a share with fewer micro-batches: the same collectives
        with torch.no_grad() if forward_only else contextlib.nullcontext():
            empty = _closing_loss(model, zero_stage, device, one_token=True)
        if not forward_only:
            _backward(model, empty, zero_stage)
    if not data:
        return [], dict.fromkeys(names, 0.0)
    outputs, sums = _to_host(logprobs, losses, torch.stack(scalars).sum(0))
    if not forward_only and not math.isfinite(sums[0]):
        model.nonfinite_loss = True      # optim_step skips the step these gradients belong to
    return outputs, dict(zip(names, sums))


def _micro_step(model: LoraModel, data: list[DatumInput], loss_impl, loss_fn_config: dict[str, float], *,
                forward_only: bool, device: torch.device, ranks: int, zero_stage: int, max_logits_bytes: int,
                packable: bool):
    """Forward and backward of one micro-batch: its per-datum logprobs and per-token losses
    (detached, on the device) and its scalars (the loss sum first)."""
    grad_ctx = torch.no_grad() if forward_only else contextlib.nullcontext()
    custom = isinstance(loss_impl, CompiledLoss)
    batch = _batch(data, device, packable)
    joined = _joined_inputs(data, device)     # copied before the forward is queued (_to_device)
    with grad_ctx:
        lengths = batch.lengths
        lp = _forward(model, zero_stage)(batch.ids, batch.mask, **batch.how, max_logits_bytes=max_logits_bytes,
                                         recompute=zero_stage != 3)    # flat, datum by datum
        logprobs = list(lp.split(lengths))
        if custom:
            losses, total, scalars = _custom_losses(loss_impl, logprobs, _inputs_on_device(data, lengths, joined, device))
        elif joined is not None and loss_impl in ELEMENTWISE:
            # One call over the batch's tokens: a few ops, not a few per datum (an RL batch has 100+
            # datums, and on a GPU each op is a launch). Each token's loss is the same formula on
            # the same values; loss:sum is summed in another order.
            per_token = loss_impl(lp, joined, loss_fn_config)
            losses, total = list(per_token.split(lengths)), per_token.sum()
            scalars = total.view(1)
        else:
            inputs = _inputs_on_device(data, lengths, joined, device)
            losses = [loss_impl(datum_lp, datum_inputs, loss_fn_config)
                      for datum_lp, datum_inputs in zip(logprobs, inputs)]
            total = lp.new_zeros((), dtype=torch.float32)
            for per_token in losses:     # summed datum by datum, in order
                total = total + per_token.sum()
            scalars = total.view(1)
    if not forward_only:
        _backward(model, total * ranks if ranks > 1 else total, zero_stage)
    return list(lp.detach().split(lengths)), [t.detach() for t in losses], scalars.detach().float()


def _forward(model: LoraModel, zero_stage: int):
    """What runs a forward. At stage 0, the engine's module's own forward: DeepSpeed's forward and
    backward add only bookkeeping there (timers, output and graph hooks; no communication: at
    stage 0 optim_step all-reduces), ~0.4 ms a step that plain PyTorch does not pay (a twentieth
    of a tiny model's step). So do the forward hooks DeepSpeed puts on the module itself (its
    prologue and epilogue: timers, a throughput timer, ZeRO-3's parameter discovery; 0.08 ms a
    call), hence `forward`, not the module's call. ZeRO's stages need DeepSpeed's own. The two go
    together: after DeepSpeed's forward, its hooks refuse a plain backward at stage 0."""
    return model.engine.module.forward if zero_stage == 0 else model.engine


def _backward(model: LoraModel, loss: torch.Tensor, zero_stage: int) -> None:
    """Gradients of `loss` added to the accumulation window (see _forward)."""
    if zero_stage == 0:
        loss.backward()
    else:
        model.engine.backward(loss, scale_wrt_gas=False)


def check_adam(adam: AdamParams) -> None:
    """Before the step (the gateway checks too): a NaN, infinite or negative value would be
    applied and leave every weight of the adapter NaN."""
    values = {f.name: getattr(adam, f.name) for f in dataclasses.fields(adam)}    # asdict deep-copies: 5x slower
    bad = [k for k, v in values.items() if not math.isfinite(v) or v < 0]
    if bad:
        raise UserError(f"invalid Adam parameters: {bad[0]} = {values[bad[0]]} (must be finite and >= 0)")
    over = [k for k, limit in ADAM_MAX.items() if values[k] > limit]
    if over:
        raise UserError(f"invalid Adam parameters: {over[0]} = {values[over[0]]} is over {ADAM_MAX[over[0]]}")
    if not (adam.beta1 < 1 and adam.beta2 < 1):
        raise UserError(f"invalid Adam parameters: beta1 and beta2 must be < 1, got {adam.beta1}, {adam.beta2}")
    if adam.eps <= 0:
        raise UserError(f"invalid Adam parameters: eps must be > 0, got {adam.eps}")


def check_dimuon(params: DimuonParams) -> None:
    """Before the step (the gateway checks too), as check_adam."""
    values = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    bad = [k for k, v in values.items() if not math.isfinite(v)]
    if bad:
        raise UserError(f"invalid Dimuon parameters: {bad[0]} = {values[bad[0]]} (must be finite)")
    if params.learning_rate < 0 or params.grad_clip_norm < 0:
        raise UserError(f"invalid Dimuon parameters: learning_rate and grad_clip_norm must be >= 0, got "
                        f"{params.learning_rate}, {params.grad_clip_norm}")
    if not 0 <= params.beta1 < 1:
        raise UserError(f"invalid Dimuon parameters: beta1 must be in [0, 1), got {params.beta1}")
    if params.damping <= 0:
        raise UserError(f"invalid Dimuon parameters: damping must be > 0, got {params.damping}")
    over = [k for k, limit in DIMUON_MAX.items() if abs(values[k]) > limit]
    if over:
        raise UserError(f"invalid Dimuon parameters: {over[0]} = {values[over[0]]} is over {DIMUON_MAX[over[0]]} "
                        f"in magnitude")


def _set_hyperparameters(optimizer: torch.optim.Optimizer, params: OptimParams) -> None:
    """This step's settings, into the optimizer's one param group."""
    for group in optimizer.param_groups:
        if isinstance(params, DimuonParams):
            group.update(lr=params.learning_rate, beta1=params.beta1, damping=params.damping,
                         rank_lr_correction_exponent=params.rank_lr_correction_exponent)
        else:
            group.update(lr=params.learning_rate, betas=(params.beta1, params.beta2), eps=params.eps,
                         weight_decay=params.weight_decay)


def optim_step(model: LoraModel, params: OptimParams, *, zero_stage: int, device: torch.device,
               ranks: int = 1) -> dict[str, float]:
    """`params`: of the model's optimizer (the engine checks). `ranks`: the job's world size (at
    stage 0 several ranks all-reduce the gradients here). A step whose gradients (or, on any
    rank, a loss since the last step) are not finite is not taken: its gradients are dropped, the
    weights and the optimizer's state stay as they were, and the metrics say
    "optim_step_skipped:sum" 1 (with no grad_norm, which is not a number then)."""
    engine = model.engine
    _set_hyperparameters(engine.optimizer, params)
    poisoned, model.nonfinite_loss = model.nonfinite_loss, False
    if zero_stage == 0:
        norm = _step_plain_gradients(model, params.grad_clip_norm, ranks, poisoned)
    else:
        engine.set_gradient_accumulation_boundary(True)
        engine.optimizer.clip_grad = params.grad_clip_norm
        _backward(model, _closing_loss(model, zero_stage, device, poisoned), zero_stage)
        engine.step()         # ZeRO's overflow check skips a step whose gradients are not finite
        norm = engine.get_global_grad_norm()
        if getattr(engine.optimizer, "overflow", False):
            norm = math.inf
        engine.set_gradient_accumulation_boundary(False)
    model.step += 1
    metrics = {"step:max": float(model.step)}
    if norm is not None and not math.isfinite(norm):
        metrics["optim_step_skipped:sum"] = 1.0
    elif norm is not None:
        metrics["grad_norm:mean"] = float(norm)
    return metrics


def _step_plain_gradients(model: LoraModel, max_norm: float, ranks: int, poisoned: bool = False) -> float:
    """Stage 0's step, as ZeRO-1/2 would take it: the gradients (zeros where a parameter has
    none, as the closing micro-step would leave) averaged over ranks, clipped to `max_norm` (0:
    no clipping), and no step at all when their norm is not finite (ZeRO's overflow check).
    `poisoned`: this rank's loss was not finite; its gradients are made NaN so that every rank's
    norm says so after the all-reduce and all of them skip. Returns the norm before clipping.
    The engine's own step is not taken, as its forward and backward are not (_forward): at stage 0
    it adds only timers, counters nothing reads and a zero_grad walking named_parameters, ~0.4 ms
    a step on a tiny model; its optimizer, the adapter's AdamW, is stepped here."""
    engine = model.engine
    for p in model.params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if poisoned:
        model.params[0].grad.fill_(math.nan)
    if ranks > 1:
        engine.set_gradient_accumulation_boundary(True)     # DeepSpeed reduces only at a boundary
        engine.allreduce_gradients()
        engine.set_gradient_accumulation_boundary(False)
    norm = _total_norm([p.grad for p in model.params])
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(model.params, max_norm, norm, foreach=True)
    _step_unless_nonfinite(engine.optimizer, norm)
    for p in model.params:
        p.grad = None
    norm = float(norm)      # the step's one read from the device, once everything is queued
    return norm if math.isfinite(norm) else math.inf    # as ZeRO says of a step it skipped


def _step_unless_nonfinite(optimizer: torch.optim.Optimizer, norm: torch.Tensor) -> None:
    """The fused AdamW's (or Dimuon's) step, a no-op where `norm` is not finite, decided on the
    device (as torch's GradScaler skips a step: the kernel reads `found_inf`, and the step count it
    added is taken back). Reading the norm first would make the host wait for the backward and leave
    the device idle while the step is queued."""
    optimizer.found_inf = torch.logical_not(torch.isfinite(norm)).float()    # shaped as the step counts
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf


def _total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all `grads` together: torch.nn.utils.get_total_norm's ops (one per-tensor
    norm kernel, then the norm of those), without its grouping by device and dtype (one device
    and dtype here), which cost more than the norms on a tiny model (~140 against ~60 us)."""
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))


def _closing_loss(model: LoraModel, zero_stage: int, device: torch.device, poisoned: bool = False, *,
                  one_token: bool = False) -> torch.Tensor:
    """A zero loss whose backward touches every parameter of the model: the micro-step that
    closes the accumulation window and runs ZeRO's reduction (stages 1-3; an empty share's
    stand-in at any stage: `one_token`). Under ZeRO-1/2 the parameters are whole, so a sum over
    them does it without running the base model; under ZeRO-3 they are partitioned and only a
    forward gathers them, so that takes a 1-token forward, as does `one_token`.
    `poisoned`: NaN instead of zero, so that ZeRO's overflow check skips the step on every rank."""
    factor = math.nan if poisoned else 0.0
    if zero_stage == 3 or one_token:
        return _forward(model, zero_stage)(torch.zeros(1, 1, dtype=torch.long, device=device)).sum() * factor
    model.engine.module.activate()       # PEFT keeps requires_grad only on the active adapter
    return sum(p.sum() for p in model.params) * factor
