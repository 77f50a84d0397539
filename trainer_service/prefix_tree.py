"""Datums that share prefixes, packed as token trees: each shared token computed once.

An RL batch is groups of rollouts of one prompt. The cookbook's arithmetic recipe sends 16
prompts x 8 samples of ~35 prompt tokens and ~12 sampled ones, so 7 of every 8 prompt tokens of
a padded batch are copies (and its few-shot opening is common to all 128). Here the datums go
into rows as a trie, in lexicographic order: a token several datums share is one position of the
row, every position attends to its ancestors only (its path; the 4-D mask records them), and its
position id is its depth.
Causal attention makes a position's value depend on its ancestors alone, so each datum gets what
it would get alone (up to the order of float sums) and the gradients of shared positions add up.
Each datum's logprobs are read at the positions of its path; a (position, target) pair that
several datums share is unembedded once: that RL batch computes under a third of its padded
positions (docs/benchmarks.md#in-the-trainer).

Attention runs path by path (`attention`): each datum's path (the tokens of one root-to-leaf
walk of a tree) gathered into a sequence of its own, attended causally by the model's own
attention as the datum alone is, and each position's output taken from one path holding it. So a
datum's logprobs in a tree are bit for bit its logprobs alone, in bf16 too (the sampler computes
each sequence alone, and RL's importance ratios rest on the two agreeing). A tree row attended
as one sequence under the 4-D mask is not: the kernel's sums over a row's keys, masked ones
among them, group a path's terms differently from a sequence of its own, and bf16 rounds the
difference into the next layer (docs/benchmarks.md#in-the-trainer).
Where the attention kernel's sums for a query depend on the sequence's length (SDPA's fp32 CPU
kernel on AVX-512), a datum whose prompt is computed in a longer path is not bit for bit alone
(no further apart than padded); a prefix computed once cannot be. Attention
costs the paths' own lengths squared instead of the rows' widths squared, in one call per
distinct path length and layer (ops a GPU launches: why padded batches keep their masked rows).

For the models logprobs.py unembeds itself (PLAIN_HEADS), without a sliding window (which a
custom mask would override), under SDPA (cpu_numerics' fp32 SDPA included; see `install`). A row
holds at most max(ROW_TOKENS, longest datum) positions, and the rows are balanced: as few as
that cap needs, each as short as keeps them that few (every row is padded to the longest).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

ROW_TOKENS = 512
# Packed only where shared prefixes save a quarter of the tokens (not for padding alone: the
# datums of an SFT batch go as they always did) and the rows a quarter of the padded batch.
MIN_SAVING = 0.25


@dataclasses.dataclass
class PathGroup:
    """The paths of one length, attended as one batch: path i is row `rows[i]`'s positions
    `nodes[i]` (root first); its outputs at the positions no path before it holds (`owned_at`)
    fill the flat positions `dest`, in order.
    The gathers go by flat indices (`index_select`, whose backward is an `index_add_`: on CPU
    3.5x faster forward and backward than indexing rows and nodes, whose backward is
    `index_put_` with accumulation)."""
    rows: torch.Tensor           # [paths]
    nodes: torch.Tensor          # [paths, length]
    dest: torch.Tensor           # [owned positions]: row * width + node
    sources: torch.Tensor        # [paths * length]: row * width + node, path after path
    owned_at: torch.Tensor       # [owned positions]: their places in `sources`

    def to(self, device: torch.device) -> "PathGroup":
        # (Not dataclasses.astuple: it deep-copies every tensor first.)
        return PathGroup(*(getattr(self, f.name).to(device) for f in dataclasses.fields(self)))


@dataclasses.dataclass
class Packing:
    ids: torch.Tensor            # [rows, longest row]
    positions: torch.Tensor      # [rows, longest row]: each position's depth in its tree
    # [rows, 1, longest row, longest row], True: attends (its ancestors and itself). `attention`
    # runs on `paths` and does not read it; it is passed all the same because without a mask
    # transformers takes position ids that restart (depths) for packed sequences and builds a mask
    # of its own (masking_utils.find_packed_sequence_indices, with a device sync). Tests read it.
    mask: torch.Tensor
    unembed: torch.Tensor        # flat positions to unembed, one per distinct (position, target)
    targets: torch.Tensor        # their targets
    expand: torch.Tensor         # every datum token's entry in `unembed`, datum after datum
    paths: list[PathGroup]       # every position in exactly one path's `dest`, padding in none


TREE_ATTENTION = "tinkerd_tree"
_INNER = "_tinkerd_tree_inner"          # an attention module's own implementation, which paths run through


def install(model: torch.nn.Module) -> bool:
    """Lets `model` (an unwrapped transformers causal LM) take token-tree batches: its attention
    runs a tree batch path by path and any other batch as before. False, nothing changed, where
    trees do not apply: heads logprobs.py does not unembed itself, a sliding window, attention
    other than SDPA (eager and flash-attention take masks and padding their own ways)."""
    from trainer_service import cpu_numerics
    from trainer_service.logprobs import PLAIN_HEADS

    config = model.config
    sliding = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    inner = getattr(config, "_attn_implementation", None)
    if config.model_type not in PLAIN_HEADS or sliding or inner not in ("sdpa", cpu_numerics.ATTENTION):
        return False
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if TREE_ATTENTION not in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS.register(TREE_ATTENTION, attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(TREE_ATTENTION, sdpa_mask)
    for layer in model.model.layers:
        setattr(layer.self_attn, _INNER, inner)
    model.set_attn_implementation(TREE_ATTENTION)
    return True


def attention(module, query, key, value, attention_mask, *, tinkerd_paths: list[PathGroup] | None = None,
              **kwargs):
    """The model's attention (`install`) for a batch of token-tree rows: on each path as on a
    sequence alone (no mask: causal), the outputs put back at the positions each path owns.
    Without `tinkerd_paths` (a padded or single batch), the model's attention as it was."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    inner = ALL_ATTENTION_FUNCTIONS[getattr(module, _INNER)]
    if tinkerd_paths is None:
        return inner(module, query, key, value, attention_mask, **kwargs)
    rows, heads, width, dim = query.shape
    outputs, dests = [], []
    for group in tinkerd_paths:
        paths, length = group.nodes.shape

        def gather(t):             # [paths, heads, length, dim], laid out as a sequence's own
            # t is [rows, heads, width, dim], a transposed view of the projections' [rows, width, heads, dim]
            by_position = t.transpose(1, 2).reshape(rows * width, t.shape[1] * dim)
            picked = by_position.index_select(0, group.sources).view(paths, length, t.shape[1], dim)
            return picked.transpose(1, 2).contiguous()
        out, _ = inner(module, gather(query), gather(key), gather(value), None, **kwargs)
        outputs.append(out.reshape(paths * length, heads, dim).index_select(0, group.owned_at))
        dests.append(group.dest)
    flat = query.new_zeros(rows * width, heads, dim, dtype=outputs[0].dtype)
    return flat.index_copy(0, torch.cat(dests), torch.cat(outputs)).view(rows, width, heads, dim), None


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many first tokens `a` and `b` have in common."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def pays(nodes: int, tokens: int, row_positions: int, padded: int) -> bool:
    """Trees are worth packing: their `nodes` save MIN_SAVING of the datums' `tokens`, and their
    rows' positions (padding included) MIN_SAVING of the `padded` batch."""
    return nodes <= (1 - MIN_SAVING) * tokens and row_positions <= (1 - MIN_SAVING) * padded


def starts_row(rows: int, row: int, length: int, shared: int, cap: int) -> bool:
    """Whether the next datum (sorted), `shared` of its `length` tokens shared with the one before,
    starts a new row (then whole) after `rows` rows, the last holding `row` positions: a datum adds
    its tokens past the shared prefix to the last row where they fit under `cap`."""
    return rows == 0 or row + length - shared > cap


def rows_of(lengths: list[int], shares: list[int], cap: int) -> tuple[int, int]:
    """(rows, the longest row's positions) of datums of `lengths` in sorted order, each sharing
    `shares` first tokens with the one before, laid out as pack() does under `cap`."""
    rows = width = row = 0
    for length, shared in zip(lengths, shares):
        if starts_row(rows, row, length, shared, cap):
            rows, row = rows + 1, length
        else:
            row += length - shared
        width = max(width, row)
    return rows, width


def balanced_cap(lengths: list[int], shares: list[int], cap: int) -> int:
    """The smallest row cap that lays the datums out in no more rows than `cap` does. Every row is
    padded to the longest, and filling rows to `cap` leaves the last one short: the RL batch of
    128 x 47 tokens in groups of 8 went into 5 rows of 512 for 2,096 positions (32 of its datums,
    4 groups: 2 rows of 512 for 524), each padding position computed like a real one."""
    rows, _ = rows_of(lengths, shares, cap)
    if rows == 1:
        return cap
    low, high = max(lengths), cap
    while low < high:             # `high` always lays them out in no more rows
        middle = (low + high) // 2
        if rows_of(lengths, shares, middle)[0] <= rows:
            high = middle
        else:
            low = middle + 1
    return high


def pack(tokens: list[list[int]], targets: torch.Tensor, *, row_tokens: int = ROW_TOKENS) -> Packing | None:
    """The datums' `tokens` as token trees in rows, or None where that would not save MIN_SAVING
    of the padded batch. `targets`: every datum's targets, flat, datum after datum."""
    longest = max(len(t) for t in tokens)
    cap = max(longest, row_tokens)
    rows: list[tuple[list[int], list[int]]] = []      # (tokens, depths)
    paths: list[tuple[int, list[int]]] = [(0, [])] * len(tokens)  # (row, node of each depth)
    path: list[int] = []
    order = sorted(range(len(tokens)), key=lambda i: tokens[i])
    real = sum(len(t) for t in tokens)
    lengths = [len(tokens[i]) for i in order]
    shares = [0] + [shared_prefix(tokens[j], tokens[i]) for j, i in zip(order, order[1:])]
    # The fewest nodes any layout has (rows' caps only cut sharing): if even they save too little,
    # say so before laying out every token (an SFT batch of 8 x 512 tokens: 0.8 ms of Python).
    if sum(lengths) - sum(shares) > (1 - MIN_SAVING) * real:
        return None
    cap = balanced_cap(lengths, shares, cap)
    for i, shared in zip(order, shares):     # sorted: the longest prefix shared with any earlier datum
        t = tokens[i]
        if starts_row(len(rows), len(rows[-1][0]) if rows else 0, len(t), shared, cap):
            rows.append(([], []))
            shared = 0
        row_tokens_, depths = rows[-1]
        path = path[:shared]
        for depth in range(shared, len(t)):
            depths.append(depth)
            path.append(len(row_tokens_))
            row_tokens_.append(t[depth])
        paths[i] = (len(rows) - 1, list(path))
    width = max(len(r[0]) for r in rows)
    nodes = sum(len(r[0]) for r in rows)
    if not pays(nodes, real, len(rows) * width, len(tokens) * longest):
        return None
    # Built in numpy (a small indexing op costs ~2 us there, ~20 in torch), then shared as tensors.
    ids = np.zeros((len(rows), width), dtype=np.int64)
    positions = np.zeros((len(rows), width), dtype=np.int64)
    mask = np.zeros((len(rows), 1, width, width), dtype=bool)
    for r, (row, depths) in enumerate(rows):
        ids[r, :len(row)] = row
        positions[r, :len(row)] = depths
        pad = np.arange(len(row), width)
        mask[r, 0, pad, pad] = True          # padding sees itself: no empty softmax row
    causal = np.tri(longest, dtype=bool)
    for r, path in paths:     # a datum's path: each of its positions attends to those before it
        at = np.asarray(path)
        mask[r, 0, at[:, None], at[None, :]] = causal[:len(path), :len(path)]
    flat = torch.from_numpy(np.fromiter((r * width + node for r, path in paths for node in path), np.int64,
                                        count=real))
    ids, positions, mask = torch.from_numpy(ids), torch.from_numpy(positions), torch.from_numpy(mask)
    # The distinct (position, target) pairs, in (position, target) order: one key each, as
    # torch.unique(dim=0) of the pairs gives them but ~10x faster (it sorts rows lexicographically).
    targets = targets.long()
    span = int(targets.max()) + 1
    keys, expand = torch.unique(flat * span + targets, return_inverse=True)
    return Packing(ids, positions, mask, keys // span, keys % span, expand,
                   _path_groups([paths[i] for i in order], width))


def _path_groups(paths: list[tuple[int, list[int]]], width: int) -> list[PathGroup]:
    """The root-to-leaf paths among the datums' paths (in the order they were laid out), grouped
    by length. A datum whose path the next one extends is no leaf. A row's positions are laid out
    path after path, so a leaf owns the positions laid out since the leaf before it in its row:
    the end of its path."""
    leaves: dict[int, list[tuple[int, list[int], int]]] = {}
    closed: dict[int, int] = {}              # row -> positions owned so far
    for k, (row, path) in enumerate(paths):
        following = paths[k + 1] if k + 1 < len(paths) else None
        if following and following[0] == row and following[1][:len(path)] == path:
            continue
        start = closed.get(row, 0)
        leaves.setdefault(len(path), []).append((row, path, len(path) - (path[-1] + 1 - start)))
        closed[row] = path[-1] + 1
    groups = []
    for length, of_length in sorted(leaves.items()):
        rows = torch.tensor([row for row, _, _ in of_length])
        nodes = torch.tensor([path for _, path, _ in of_length])
        owned = torch.arange(length)[None, :] >= torch.tensor([first for _, _, first in of_length])[:, None]
        sources = rows[:, None] * width + nodes
        groups.append(PathGroup(rows, nodes, sources[owned], sources.reshape(-1),
                                owned.reshape(-1).nonzero().squeeze(1)))
    return groups
