"""Datums that share prefixes, packed as token trees: each shared token computed once.

An RL batch is groups of rollouts of one prompt. The cookbook's arithmetic recipe sends 16
prompts x 8 samples of ~35 prompt tokens and ~12 sampled ones, so 7 of every 8 prompt tokens of
a padded batch are copies (and its few-shot opening is common to all 128). Here the datums go
into rows as a trie, in lexicographic order: a token several datums share is one position of the
row, every position attends to its ancestors only (a 4-D mask), and its position id is its depth.
Causal attention makes a position's value depend on its ancestors alone, so each datum gets what
it would get alone (up to the order of float sums) and the gradients of shared positions add up.
Each datum's logprobs are read at the positions of its path; a (position, target) pair that
several datums share is unembedded once. SmolLM2 fp32, that RL batch: 5,888 padded positions ->
1,664, forward+backward 74 s -> 19-25 s on 2 cores.

Only in fp32 (see `packable`), for the models logprobs.py unembeds itself (PLAIN_HEADS), without
a sliding window (which a custom mask would override), under SDPA or eager attention. A row
holds at most max(ROW_TOKENS, longest datum) positions: attention over a row grows with its square.
"""

from __future__ import annotations

import dataclasses

import torch

ROW_TOKENS = 512
# Packed only where shared prefixes save a quarter of the tokens (not for padding alone: the
# datums of an SFT batch go as they always did) and the rows a quarter of the padded batch.
MIN_SAVING = 0.25


@dataclasses.dataclass
class Packing:
    ids: torch.Tensor            # [rows, longest row]
    positions: torch.Tensor      # [rows, longest row]: each position's depth in its tree
    mask: torch.Tensor           # [rows, 1, longest row, longest row], True: attends (its ancestors and itself)
    unembed: torch.Tensor        # flat positions to unembed, one per distinct (position, target)
    targets: torch.Tensor        # their targets
    expand: torch.Tensor         # every datum token's entry in `unembed`, datum after datum


def packable(config, dtype: torch.dtype) -> bool:
    """Whether this model's batches may go as token trees. Not in 16-bit yet: in bf16 a datum's
    logprobs in a tree move further from its logprobs alone than padding moves them (SmolLM2,
    an RL batch of 4 x 8 rollouts, with the sampler's rounding (cpu_numerics.py): tree vs alone
    mean 0.021 / max 0.24 nats, padded vs alone 0.0026 / 0.18), and RL's importance ratios rest
    on the trainer matching the sampler, which computes each sequence alone. fp32: 3e-6 / 3e-5."""
    from trainer_service.logprobs import PLAIN_HEADS

    if dtype != torch.float32:
        return False
    sliding = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    # a 4-D boolean mask is taken as given by these attention implementations (not flash-attention's)
    return (config.model_type in PLAIN_HEADS and not sliding
            and getattr(config, "_attn_implementation", "sdpa") in ("sdpa", "eager"))


def pack(tokens: list[list[int]], targets: torch.Tensor, *, row_tokens: int = ROW_TOKENS) -> Packing | None:
    """The datums' `tokens` as token trees in rows, or None where that would not save MIN_SAVING
    of the padded batch. `targets`: every datum's targets, flat, datum after datum."""
    longest = max(len(t) for t in tokens)
    cap = max(longest, row_tokens)
    rows: list[tuple[list[int], list[int]]] = []      # (tokens, depths)
    paths: list[tuple[int, list[int]]] = [(0, [])] * len(tokens)  # (row, node of each depth)
    previous: list[int] = []
    path: list[int] = []
    for i in sorted(range(len(tokens)), key=lambda i: tokens[i]):
        t = tokens[i]
        shared = 0
        for a, b in zip(previous, t):     # sorted: the longest prefix shared with any earlier datum
            if a != b:
                break
            shared += 1
        if not rows or len(rows[-1][0]) + len(t) - shared > cap:
            rows.append(([], []))
            shared = 0
        row_tokens_, depths = rows[-1]
        path = path[:shared]
        for depth in range(shared, len(t)):
            depths.append(depth)
            path.append(len(row_tokens_))
            row_tokens_.append(t[depth])
        paths[i] = (len(rows) - 1, list(path))
        previous = t
    width = max(len(r[0]) for r in rows)
    nodes, real = sum(len(r[0]) for r in rows), sum(len(t) for t in tokens)
    if nodes > (1 - MIN_SAVING) * real or len(rows) * width > (1 - MIN_SAVING) * len(tokens) * longest:
        return None
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    positions = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), 1, width, width, dtype=torch.bool)
    for r, (row, depths) in enumerate(rows):
        ids[r, :len(row)] = torch.tensor(row)
        positions[r, :len(row)] = torch.tensor(depths)
        pad = torch.arange(len(row), width)
        mask[r, 0, pad, pad] = True          # padding sees itself: no empty softmax row
    causal = torch.ones(longest, longest, dtype=torch.bool).tril()
    for r, path in paths:     # a datum's path: each of its positions attends to those before it
        at = torch.tensor(path)
        mask[r, 0, at[:, None], at[None, :]] = causal[:len(path), :len(path)]
    flat = torch.tensor([r * width + node for r, path in paths for node in path])
    pairs, expand = torch.unique(torch.stack([flat, targets.long()], 1), dim=0, return_inverse=True)
    return Packing(ids, positions, mask, pairs[:, 0].contiguous(), pairs[:, 1].contiguous(), expand)
