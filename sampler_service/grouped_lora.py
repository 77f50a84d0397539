"""Grouped LoRA shrink/expand for vLLM's CPU punica wrapper (installed by worker_ext.py).

vLLM 0.32's PyTorch ops (`vllm/lora/ops/torch_ops/lora_ops.py`) gather each token's whole padded
adapter matrix (`weights[indices]`: [tokens, max_rank, hidden]) and einsum per token, so every
token pays for a copy of a max_rank-sized matrix in every LoRA layer. Here a batch is split into
the adapter slots it holds and each slot does one matmul over its own rows, with its weights cut
to the adapter's true rank: the stacked weights are zero past it, so the cut changes nothing but
the cost (a rank-8 adapter in a rank-64 engine costs like rank 8).

Slot -1 (base-model rows) gets nothing added: shrink writes zeros there, expand leaves them be.
Same argument order as vLLM's ops, so they replace them one for one.
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


def true_rank(weights: torch.Tensor, slot: int, rank_dim: int) -> int:
    """How far along its rank dimension the slot's matrix is nonzero (0 for an all-zero one).

    Cached on the stacked tensor until it is written again: vLLM writes a slot in place (zero,
    then copy), which bumps the tensor's version counter, so a new adapter in a slot is rescanned.
    """
    m = _slot_matrix(weights, slot)
    try:
        version = weights._version
    except RuntimeError:      # an inference tensor keeps no version: no cache, no cut
        return m.shape[rank_dim]
    cache = getattr(weights, "_tinkerd_ranks", None)
    if cache is None or cache[0] != version:
        cache = (version, {})
        weights._tinkerd_ranks = cache
    rank = cache[1].get(slot)
    if rank is None:
        used = m.ne(0).any(dim=1 - rank_dim).nonzero()
        rank = cache[1][slot] = int(used[-1]) + 1 if used.numel() else 0
    return rank


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
