"""A forward_backward's datums in micro-batches whose saved activations fit a memory budget.

What a batch keeps for its backward grows with its tokens: even a small model in fp32 keeps over
a MiB a token, so an RL batch of 128 datums held many GiB at once and the trainer was OOM-killed
(docs/benchmarks.md#in-the-trainer; the SDK's retries hid it as a slow step).
Losses are sums, so the datums may go through forward and backward in groups whose gradients add
up: the same gradient, summed in another order, with the memory of one group.

A group that goes as token trees (prefix_tree.py: an RL batch's rollouts of one prompt) keeps
much less than its padded size: each shared token is one position, and only the attention, run
path by path, keeps copies per datum token. So where the model packs, the plan prices a group
by its trees (`TreeCost`: per tree position and per path token, fitted at start-up from a packed
probe against the padded ones) and keeps more datums together: fewer micro-batches, fewer
computing the shared prompt again (docs/benchmarks.md#in-the-trainer).

What a token costs is measured once, at start-up (`measure`): forwards of padded batches
through a scratch adapter of the largest rank on every target module (the costliest adapter
this trainer accepts), counting the tensors autograd keeps for the backward. The fp32 logits of
the models whose head logprobs.py unembeds in chunks are bounded apart (--max-logits-mib); for the
others the probe counts them per token too.
"""

from __future__ import annotations

import dataclasses
import math
import os

import torch

from trainer_service import prefix_tree
from trainer_service.logprobs import token_logprobs

PROBE_LENGTHS = (64, 256)     # two batch lengths: what a token keeps, and how that grows with the length
# Real batches keep 0-8% more than the probes say (their shapes differ: many short rows, loss
# inputs, the head's chunks; the tests' models, 3-256 tokens, tests/trainer/test_microbatches.py).
MARGIN = 1 / 8


@dataclasses.dataclass(frozen=True)
class TokenCost:
    """Bytes autograd keeps per padded token of a micro-batch: `fixed`, plus `per_position` for
    each position of its longest datum (a padded batch's attention mask; an eager attention's
    probabilities grow so too)."""
    fixed: int
    per_position: float
    tree: TreeCost | None = None         # where the model packs token trees

    def of(self, datums: int, longest: int) -> int:
        return int(datums * longest * (self.fixed + self.per_position * longest))

    def tokens_within(self, budget_bytes: int, longest: int) -> int:
        return int(budget_bytes // (self.fixed + self.per_position * longest))


@dataclasses.dataclass(frozen=True)
class TreeCost:
    """Bytes autograd keeps for a micro-batch packed as token trees: `per_node` for each position
    of its trees' rows, `per_path_token` for each token of its datums (their attention's gathered
    queries, keys, values and output: prefix_tree.attention), plus the padded `per_position` for
    each of those per position of the longest."""
    per_node: int
    per_path_token: int
    per_position: float = 0.0

    def of(self, rows: int, width: int, path_tokens: int, longest: int) -> int:
        """`rows` of `width` positions (with their padding), and their 4-D mask, a byte a pair."""
        nodes = rows * width
        return int(nodes * (self.per_node + width) + path_tokens * (self.per_path_token + self.per_position * longest))


def default_budget_bytes(device: torch.device) -> int:
    """--activation-mib 0: a quarter of the GPU's memory (of its --gpu-memory-fraction share), or a
    sixteenth of the host's (its cgroup limit where lower). A step's peak is about twice its budget over the trainer's resting size
    (the backward's gradients of the activations, the logits' chunk, the allocator's slack:
    docs/benchmarks.md#in-the-trainer), and the host also holds the base model and on one
    machine the sampler."""
    if device.type == "cuda":
        from tinkerd import hardware
        return hardware.gpu_memory_bytes(device) // 4
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return total // 16


def saved_bytes(causal_lm: torch.nn.Module, forward) -> int:
    """What autograd keeps in `forward()`: every saved tensor's storage counted once, the weights never."""
    weights = {p.untyped_storage().data_ptr() for p in causal_lm.parameters()}
    saved: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        forward()
    return sum(saved.values())


def measure(causal_lm: torch.nn.Module, device: torch.device, *, recompute: bool,
            trees: bool = False) -> TokenCost:
    """What autograd keeps per padded token in a forward with the active adapter (the caller makes
    it the costliest one), from two padded batches of two rows (the second half as long: a mask,
    as real batches have). `recompute`: as the trainer unembeds (logprobs.py), so that the head
    counts as it will. `trees`: the model packs batches as token trees; a packed probe (two datums
    sharing three quarters of their tokens) prices those too (`TreeCost`)."""
    chunk_bytes = 4 * causal_lm.config.vocab_size * 16      # as a long batch's chunks go
    per_token = []
    for length in PROBE_LENGTHS:
        ids = torch.zeros(2, length, dtype=torch.long, device=device)
        mask = torch.ones(2, length, dtype=torch.long)
        mask[1, length // 2:] = 0
        real = mask.view(-1).nonzero().squeeze(1).to(device)
        kept = saved_bytes(causal_lm, lambda: token_logprobs(causal_lm, ids, mask.to(device), ids, real,
                                                              max_logits_bytes=chunk_bytes, recompute=recompute))
        per_token.append(kept / (2 * length))
    (short, long_), (t_short, t_long) = PROBE_LENGTHS, per_token
    per_position = max(0.0, (t_long - t_short) / (long_ - short))
    fixed = max(t_short - per_position * short, t_long - per_position * long_)
    tree = _tree_cost(causal_lm, device, fixed, per_position, chunk_bytes, recompute) if trees else None
    return TokenCost(fixed=math.ceil(fixed * (1 + MARGIN)), per_position=per_position * (1 + MARGIN), tree=tree)


def _tree_cost(causal_lm: torch.nn.Module, device: torch.device, fixed: float, per_position: float,
               chunk_bytes: int, recompute: bool) -> TreeCost | None:
    """Fitted from a packed probe of N tree positions and P path tokens of length L that keeps S
    bytes, with a padded token (a position and its own path token at once) keeping `fixed`:
    N * per_node + P * (per_path_token + per_position * L) = S, per_node + per_path_token = fixed."""
    from trainer_service import training

    length, shared = PROBE_LENGTHS[-1], 3 * PROBE_LENGTHS[-1] // 4
    tokens = [[1] * length, [1] * shared + [2] * (length - shared)]
    data = [training.DatumInput(t, {"target_tokens": torch.tensor(t)}) for t in tokens]
    batch = training._batch(data, device, packable=True)
    if batch.mask is None or batch.mask.dim() != 4:
        return None                                     # not packed: price groups padded
    kept = saved_bytes(causal_lm, lambda: token_logprobs(causal_lm, batch.ids, batch.mask, **batch.how,
                                                          max_logits_bytes=chunk_bytes, recompute=recompute))
    rows, width = batch.ids.shape
    nodes, paths, mask = rows * width, 2 * length, rows * width * width
    per_path_token = (kept - mask - nodes * fixed - paths * per_position * length) / (paths - nodes)
    per_path_token = min(fixed, max(0.0, per_path_token))
    return TreeCost(per_node=math.ceil((fixed - per_path_token) * (1 + MARGIN)),
                    per_path_token=math.ceil(per_path_token * (1 + MARGIN)), per_position=per_position * (1 + MARGIN))


def plan(lengths: list[int], cost: TokenCost, budget_bytes: int, order: list[int] | None = None,
         tokens: list[list[int]] | None = None) -> list[list[int]]:
    """The datums (indices into `lengths`) in micro-batches, each padded to its longest within
    `budget_bytes`: all in one, in their order, where the batch fits (a forward_backward as it
    always was); else in `order`, by default longest first (which pads least), as many to a group
    as fit. A datum that alone exceeds the budget goes alone. With the datums' `tokens`, `order`
    sorted by them and a `cost.tree`, a group whose trees would pack is priced as trees."""
    if not lengths:
        return []
    order = order if order is not None else sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    tokens = tokens if cost.tree is not None else None
    whole = _Group(cost, tokens, lengths)
    for i in order:
        whole.add(i)
    if whole.bytes() <= budget_bytes:
        return [list(range(len(lengths)))]
    groups: list[list[int]] = []
    group = _Group(cost, tokens, lengths)
    for i in order:
        if group.members and group.with_(i) > budget_bytes:
            groups.append(group.members)
            group = _Group(cost, tokens, lengths)
        group.add(i)
    return groups + [group.members]


@dataclasses.dataclass(frozen=True)
class _Trees:
    """The rows datums sorted by tokens pack into, filled to the cap: each datum adds its tokens
    past the prefix it shares with the one before, a datum that does not fit its row's cap starts
    the next row whole. prefix_tree.pack then narrows the cap as far as the rows stay as few
    (balanced_cap): fewer padding positions than priced here. Priced as filled, on purpose:
    priced as balanced, the tiny model's 4 x 8 rollouts came to 6.2 MB against the 7.5 MB they
    keep (the fitted TreeCost undercounts its tree positions; the filled rows' padding covered
    that: tests/trainer/test_microbatches.py)."""
    rows: int = 0
    width: int = 0            # the longest row: every row is padded to it
    row: int = 0              # the last row's positions
    nodes: int = 0            # positions in all rows, without their padding
    path_tokens: int = 0      # the datums' own tokens

    def plus(self, length: int, shared: int, longest: int) -> "_Trees":
        cap = max(longest, prefix_tree.ROW_TOKENS)
        rows, row, new = self.rows, self.row + length - shared, length - shared
        if prefix_tree.starts_row(self.rows, self.row, length, shared, cap):
            rows, row, new = rows + 1, length, length
        return _Trees(rows, max(self.width, row), row, self.nodes + new, self.path_tokens + length)


class _Group:
    """A micro-batch being planned, and its price: padded, or as the token trees it would pack
    into (prefix_tree.pack's thresholds), their rows padded to the longest."""

    def __init__(self, cost: TokenCost, tokens: list[list[int]] | None, lengths: list[int]):
        self.cost, self.tokens, self.lengths = cost, tokens, lengths
        self.members: list[int] = []
        self.longest, self.trees = 0, _Trees()

    def _added(self, i: int) -> tuple[int, _Trees]:
        longest = max(self.longest, self.lengths[i])
        if self.tokens is None:
            return longest, self.trees
        shared = prefix_tree.shared_prefix(self.tokens[self.members[-1]], self.tokens[i]) if self.members else 0
        return longest, self.trees.plus(self.lengths[i], shared, longest)

    def _price(self, datums: int, longest: int, trees: _Trees) -> int:
        padded = self.cost.of(datums, longest)
        if self.tokens is None or not prefix_tree.pays(trees.nodes, trees.path_tokens, trees.rows * trees.width,
                                                       datums * longest):
            return padded
        return min(padded, self.cost.tree.of(trees.rows, trees.width, trees.path_tokens, longest))

    def with_(self, i: int) -> int:
        return self._price(len(self.members) + 1, *self._added(i))

    def add(self, i: int) -> None:
        self.longest, self.trees = self._added(i)
        self.members.append(i)

    def bytes(self) -> int:
        return self._price(len(self.members), self.longest, self.trees)
