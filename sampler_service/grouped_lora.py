"""Grouped LoRA shrink/expand for vLLM's CPU punica wrapper (installed by worker_ext.py).

vLLM 0.32's PyTorch ops (`vllm/lora/ops/torch_ops/lora_ops.py`) gather each token's whole padded
adapter matrix (`weights[indices]`: [tokens, max_rank, hidden]) and einsum per token, so every
token pays for a copy of a max_rank-sized matrix in every LoRA layer. Here a batch is split into
the adapter slots it holds and each slot does one matmul over its own rows, with its weights cut
to the adapter's true rank: the stacked weights are zero past it, so the cut changes nothing but
the cost (a rank-8 adapter in a rank-64 engine costs like rank 8).

Slot -1 (base-model rows) gets nothing added: shrink writes zeros there, expand leaves them be.
Same argument order as vLLM's ops, so they replace them one for one. `add_lora_linear` does a
whole LoRA linear layer (its shrink and expand, every slice) with the same numbers, bit for bit,
and less work (worker_ext.py installs it on the CPU punica wrapper).
"""

from __future__ import annotations

import torch

# Rows of one slot: a slice when they are contiguous (no copy), else an index tensor.
Rows = slice | torch.Tensor
Plan = list[tuple[int, Rows]]


def plan_from_runs(slots: list[int], lengths: list[int]) -> Plan:
    """(slot, rows) per distinct slot, from consecutive runs of tokens sharing a slot."""
    spans: dict[int, list[tuple[int, int]]] = {}
    start = 0
    for slot, n in zip(slots, lengths):
        if n:
            spans.setdefault(slot, []).append((start, start + n))
        start += n
    plan: Plan = []
    for slot, ranges in spans.items():
        if len(ranges) == 1:
            plan.append((slot, slice(*ranges[0])))
        else:
            plan.append((slot, torch.cat([torch.arange(a, b) for a, b in ranges])))
    return plan


def plan_from_tokens(indices: torch.Tensor) -> Plan:
    slots, counts = torch.unique_consecutive(indices, return_counts=True)
    return plan_from_runs(slots.tolist(), counts.tolist())


def _slot_matrix(weights: torch.Tensor, slot: int) -> torch.Tensor:
    """One slot's 2-D matrix from stacked weights, [slots, 1, out, in] or [slots, out, in]."""
    m = weights[slot]
    return m[0] if m.dim() == 3 else m


def _slot_cache(weights: torch.Tensor) -> dict | None:
    """What this module keeps per slot of a stacked tensor, until the tensor is written again:
    vLLM writes a slot in place (zero, then copy), which bumps the tensor's version counter, so a
    new adapter in a slot is seen. None for an inference tensor (it keeps no version)."""
    try:
        version = weights._version
    except RuntimeError:
        return None
    cache = getattr(weights, "_tinkerd_slots", None)
    if cache is None or cache[0] != version:
        cache = weights._tinkerd_slots = (version, {})
    return cache[1]


def true_rank(weights: torch.Tensor, slot: int, rank_dim: int) -> int:
    """How far along its rank dimension the slot's matrix is nonzero (0 for an all-zero one)."""
    m = _slot_matrix(weights, slot)
    cache = _slot_cache(weights)
    if cache is None:         # no version to know a rewrite by: no cut
        return m.shape[rank_dim]
    rank = cache.get(("rank", slot))
    if rank is None:
        used = m.ne(0).any(dim=1 - rank_dim).nonzero()
        rank = cache[("rank", slot)] = int(used[-1]) + 1 if used.numel() else 0
    return rank


def _widened(weights: torch.Tensor, slot: int) -> tuple[int, torch.Tensor]:
    """The slot's A (rank first) cut to its true rank, in fp32, kept until the slot is rewritten."""
    rank = true_rank(weights, slot, rank_dim=0)
    cache = _slot_cache(weights)
    a = None if cache is None else cache.get(("fp32", slot))
    if a is None:
        a = _slot_matrix(weights, slot)[:rank].to(torch.float32)
        if cache is not None:
            cache[("fp32", slot)] = a
    return rank, a


def shrink(inputs: torch.Tensor, weights: torch.Tensor, output: torch.Tensor, plan: Plan,
           scale: float) -> None:
    """output[rows, :max_rank] = scale * inputs[rows] @ A_slot.T for each slot; zero for slot -1."""
    x = inputs.to(output.dtype)
    width = weights.shape[-2]
    for slot, rows in plan:
        if slot < 0:             # base rows: nothing added
            _write(output, rows, 0, width, None, add=False)
            continue
        rank = true_rank(weights, slot, rank_dim=0)
        a = _slot_matrix(weights, slot)[:rank].to(output.dtype)
        y = torch.mm(x[rows], a.t()).mul_(scale)
        if rank < width:          # the rank's padding comes out zero, as in the full product
            y = torch.nn.functional.pad(y, (0, width - rank), value=0.0)
        _write(output, rows, 0, width, y, add=False)


def expand(inputs: torch.Tensor, weights: torch.Tensor, output: torch.Tensor, plan: Plan,
           offset: int, size: int, add: bool) -> None:
    """output[rows, offset:offset+size] (+)= inputs[rows] @ B_slot.T for each slot; slot -1
    rows get nothing (zero when not adding)."""
    x = inputs.to(output.dtype)
    for slot, rows in plan:
        if slot < 0:
            if not add:
                _write(output, rows, offset, size, None, add=False)
            continue
        rank = true_rank(weights, slot, rank_dim=1)
        if rank == 0 and add:     # an all-zero B (an untrained adapter) adds nothing
            continue
        b = _slot_matrix(weights, slot)[:size, :rank].to(output.dtype)
        _write(output, rows, offset, size, torch.mm(x[rows, :rank], b.t()), add)


def _write(output: torch.Tensor, rows: Rows, offset: int, size: int, y: torch.Tensor | None,
           add: bool) -> None:
    """output[rows, offset:offset+size] = y, or += y; y None means zeros."""
    cols = output[:, offset:offset + size]
    if isinstance(rows, slice):
        target = cols[rows]
        if y is None:
            target.zero_()
        elif add:
            target.add_(y)
        else:
            target.copy_(y)
    elif y is None:
        cols.index_fill_(0, rows, 0)
    elif add:
        cols.index_add_(0, rows, y)
    else:
        cols.index_copy_(0, rows, y)


def add_lora_linear(y: torch.Tensor, x: torch.Tensor, lora_a_stacked: tuple, lora_b_stacked: tuple,
                    scale: float, output_slices: tuple, plan: Plan) -> None:
    """y[rows, slice i] += (x[rows] @ A_i^T * scale, in fp32, rounded to y's dtype) @ B_i^T, per slot.

    The same numbers as vLLM's CPU `add_lora_linear` with the ops above (shrink into a zeroed
    fp32 buffer per slice, then expand from it in y's dtype), bit for bit, without the work that
    is the same for every slice or every step: x widened once, not once per slice; each slot's A
    widened once until vLLM rewrites the slot (`_widened`); no buffer, no padding to the engine's
    maximum rank and back; and the plan made once per step (`plan`, worker_ext._step) instead of
    once per op (docs/benchmarks.md#in-the-sampler). The fp32 copies of A cost at most twice the
    bf16 slots' A in memory."""
    xf = x.to(torch.float32)
    offset = 0
    for a_stacked, b_stacked, size in zip(lora_a_stacked, lora_b_stacked, output_slices):
        for slot, rows in plan:
            if slot < 0:                  # base rows: nothing added
                continue
            rank_b = true_rank(b_stacked, slot, rank_dim=1)
            if rank_b == 0:               # an all-zero B (an untrained adapter) adds nothing
                continue
            rank_a, a = _widened(a_stacked, slot)
            h = torch.mm(xf[rows], a.t())
            if scale != 1.0:
                h.mul_(scale)
            if rank_b > rank_a:           # the buffer's zero padding, where B reaches past A
                h = torch.nn.functional.pad(h, (0, rank_b - rank_a), value=0.0)
            b = _slot_matrix(b_stacked, slot)[:size, :rank_b].to(y.dtype)
            _write(y, rows, offset, size, torch.mm(h[:, :rank_b].to(y.dtype), b.t()), add=True)
        offset += size


# ---- vLLM's op signatures (`vllm/lora/ops/torch_ops/lora_ops.py`) -------------------------------

_ORIGINALS: dict[str, object] = {}
OP_NAMES = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice", "sgmv_shrink", "sgmv_expand",
            "sgmv_expand_slice")


def _runs(lora_indices_tensor: torch.Tensor, seq_len_tensor: torch.Tensor) -> Plan:
    return plan_from_runs(lora_indices_tensor.tolist(), seq_len_tensor.tolist())


def _rows_match(inputs: torch.Tensor, output: torch.Tensor) -> bool:
    """vLLM's expand broadcasts a single input row over all output rows; that case (not one
    the CPU wrapper makes) goes to vLLM's own op."""
    return inputs.shape[0] == output.shape[0]


def bgmv_shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling=1.0):
    shrink(inputs, lora_a_weights, output_tensor, plan_from_tokens(lora_indices_tensor), scaling)


def sgmv_shrink(inputs, lora_a_weights, output_tensor, b_seq_start_loc, seq_len_tensor,
                lora_indices_tensor, batches, max_seq_length, token_nums, scaling):
    shrink(inputs, lora_a_weights, output_tensor, _runs(lora_indices_tensor, seq_len_tensor), scaling)


def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs=True):
    if not _rows_match(inputs, output_tensor):
        return _ORIGINALS["bgmv_expand"](inputs, lora_b_weights, output_tensor, lora_indices_tensor,
                                         add_inputs)
    size = min(lora_b_weights.shape[-2], output_tensor.shape[1])   # vLLM's common_len
    expand(inputs, lora_b_weights, output_tensor, plan_from_tokens(lora_indices_tensor), 0, size,
           add_inputs)


def sgmv_expand(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor,
                lora_indices_tensor, batches, max_seq_length, token_nums, add_inputs=False):
    size = min(lora_b_weights.shape[-2], output_tensor.shape[1])
    expand(inputs, lora_b_weights, output_tensor, _runs(lora_indices_tensor, seq_len_tensor), 0, size,
           add_inputs)


def bgmv_expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset,
                      slice_size, add_inputs=True):
    expand(inputs, lora_b_weights, output_tensor, plan_from_tokens(lora_indices_tensor), slice_offset,
           slice_size, add_inputs)


def sgmv_expand_slice(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor,
                      lora_indices_tensor, batches, max_seq_length, token_nums, slice_offset,
                      slice_size, add_inputs=False):
    expand(inputs, lora_b_weights, output_tensor, _runs(lora_indices_tensor, seq_len_tensor),
           slice_offset, slice_size, add_inputs)


def install(*modules) -> None:
    """Put the grouped ops in place of vLLM's in each module that holds them by name (vLLM's
    lora_ops, where the sgmv ops look up the bgmv ones, and the CPU wrapper that imported them)."""
    ours = globals()
    for module in modules:
        for name in OP_NAMES:
            current = getattr(module, name, None)
            if current is None or current is ours[name]:
                continue
            _ORIGINALS.setdefault(name, current)
            setattr(module, name, ours[name])


def uninstall(*modules) -> None:
    """vLLM's own ops back (benchmarks compare the two in one engine)."""
    for module in modules:
        for name in OP_NAMES:
            if name in _ORIGINALS and hasattr(module, name):
                setattr(module, name, _ORIGINALS[name])
