"""Dimuon, Tinker's second optimizer: a matrix-sign step per LoRA matrix, preconditioned.

One step, for each LoRA matrix W (a or b of one layer) with gradient G (after the global clip):

    M <- beta1 * M + (1 - beta1) * G                    the momentum, Dimuon's only state
    r_i = mean_j M_ij^2 / mean(M^2),  c_j = mean_i M_ij^2 / mean(M^2)
    X  = diag(r + damping)^(-1/4) M diag(c + damping)^(-1/4)   the damped row/column preconditioner
    O  = msign(X)                                       by Newton-Schulz iteration
    W <- W - learning_rate * (rank / 32)^(-rank_lr_correction_exponent) * sqrt(rank) * O / |O|_F

so every matrix moves by a step of Frobenius norm learning_rate * sqrt(rank), rank-corrected
(O has `rank` singular values near 1: the normalization makes the norm exact). The row and column
statistics are relative to their mean, so the step does not depend on the gradients' scale
(nor does msign); `damping` bounds how much the preconditioner scales any row or column.

The matrices are stepped in batches of one shape each (a model has a few: one per distinct layer
width, a and b apart), each batch a handful of batched ops rather than a few dozen ops per
matrix, and kept in their own orientation, so that the passes over them (momentum, step) are
contiguous; big batches go in slices that fit a core's cache. The Newton-Schulz steps run on the
small rank x rank side (sign_factors), all batches together. The momentum lives in one buffer per
shape; each parameter's state["momentum"] is a view of its slice (what a checkpoint saves, and
loads back: load_state_dict rebuilds the buffers). On the host, a step whose gradients are not
finite is skipped there and then; on a device, decided there (no wait for the backward).

Under several ranks every rank holds the whole momentum and takes the same step on the all-reduced
gradients: a matrix sign needs the whole matrix, which ZeRO's partitions would cut (engine.py runs
a Dimuon model's engine as stage 0).
"""

from __future__ import annotations

import dataclasses
import math

import torch

# Newton-Schulz: a quintic iteration that takes every singular value in (0, 1] near 1 in a few
# steps (the coefficients of Muon, Keller Jordan 2024). Internal constants, as Tinker's.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
TINY = 1e-30          # below any norm a nonzero fp32 matrix has; keeps 0 / 0 out of a zero momentum
RANK_REFERENCE = 32   # the rank whose learning rate needs no correction
# A batch is stepped a slice of matrices at a time, up to this many elements (1 MiB as float64),
# so that a slice's temporaries stay in a core's cache instead of each going through memory
# (docs/benchmarks.md#dimuon).
SLICE_ELEMENTS = 1 << 17


@dataclasses.dataclass
class _Batch:
    params: list[torch.nn.Parameter]
    momentum: torch.Tensor           # [len(params), rows, cols], float32; state["momentum"]: its slices
    views: list[torch.Tensor]


class Dimuon(torch.optim.Optimizer):
    """`params`: one adapter's LoRA matrices, all of LoRA rank `rank`. The per-step settings are
    the param group's (training.py sets them from each request): lr, beta1, damping,
    rank_lr_correction_exponent. A `found_inf` attribute (a 0-d tensor, as torch's GradScaler
    sets on its optimizers) makes the step a no-op where it is 1: read on the host, where that
    costs nothing, and decided on the device elsewhere (reading it would wait for the backward)."""

    def __init__(self, params, rank: int):
        params = list(params)
        bad = [tuple(p.shape) for p in params if p.dim() != 2]
        if bad:
            raise ValueError(f"Dimuon steps matrices; got parameters of shape {bad[:3]}")
        super().__init__(params, dict(lr=0.0, beta1=0.9, damping=1e-4, rank_lr_correction_exponent=0.175))
        self.rank = rank
        self._batches: list[_Batch] | None = None

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self._batches = None        # the loaded momenta are the state now: batched again at the next step

    def _batched(self) -> list[_Batch]:
        """The matrices by shape, in parameter order, each shape's momentum one buffer (holding
        what state["momentum"] held, zeros where none) and the state views of it; in batches of
        up to SLICE_ELEMENTS."""
        if self._batches is not None:
            return self._batches
        by_shape: dict[tuple[int, int], list[torch.nn.Parameter]] = {}
        for p in self.param_groups[0]["params"]:
            by_shape.setdefault(tuple(p.shape), []).append(p)
        self._batches = []
        for params in by_shape.values():
            momentum = torch.stack([self.state[p]["momentum"].to(p.device, torch.float32) if "momentum" in self.state[p]
                                    else torch.zeros_like(p, dtype=torch.float32) for p in params])
            views = list(momentum.unbind(0))
            for p, view in zip(params, views):
                self.state[p]["momentum"] = view
            per = max(1, SLICE_ELEMENTS // params[0].numel())
            self._batches += [_Batch(params[i:i + per], momentum[i:i + per], views[i:i + per])
                              for i in range(0, len(params), per)]
        return self._batches

    @torch.no_grad()
    def step(self, closure=None):
        group = self.param_groups[0]
        correction = (self.rank / RANK_REFERENCE) ** -group["rank_lr_correction_exponent"]
        size = group["lr"] * correction * math.sqrt(self.rank)     # each matrix's step, Frobenius
        weight = 1 - group["beta1"]
        batches = self._batched()
        views = [v for batch in batches for v in batch.views]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for batch in batches for p in batch.params]
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and read_on_host(found_inf):
            if found_inf.item():
                return None         # a skipped step: weights and momentum keep their values
            found_inf = None
        if found_inf is None:
            torch._foreach_lerp_(views, grads, weight)
        else:                       # skipped on the device: the momentum lerps by 0, the weights move by 0
            keep = 1 - found_inf.float()
            weight, size = weight * keep, size * keep
            torch._foreach_lerp_(views, [g.nan_to_num(0.0, 0.0, 0.0) for g in grads], [weight] * len(views))
        damping = torch.full((), group["damping"], device=batches[0].momentum.device)
        preconditioned = [precondition(batch.momentum, damping) for batch in batches]
        moves = [torch.bmm(left, y) if y.shape[1] <= y.shape[2] else torch.bmm(y, left.mT)
                 for (y, _), left in zip(preconditioned, sign_factors(preconditioned, size))]
        params = [p for batch in batches for p in batch.params]
        moved = [m for move in moves for m in move.unbind(0)]
        torch._foreach_sub_(params, [m.to(p.dtype) for m, p in zip(moved, params)] if params[0].dtype != moved[0].dtype
                            else moved)
        return None


def read_on_host(found_inf: torch.Tensor) -> bool:
    """Whether reading `found_inf` costs nothing (it is on the host): else the step decides on the
    device, as GradScaler's optimizers do."""
    return found_inf.device.type == "cpu"


def precondition(momentum: torch.Tensor, damping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """X = diag(r + damping)^(-1/4) M diag(c + damping)^(-1/4) for a batch [k, rows, cols], with r
    and c each row's and column's mean square relative to the matrix's (module doc): r_i = rows *
    |row i|^2 / |M|_F^2. Scaled by each matrix's largest entry first, so that squares neither
    overflow nor vanish. Returned as (Y, f): Y the momentum with its long side's factor applied,
    f [k, 1, n] the short side's (n = min(rows, cols)), so that X = diag(f) Y (rows <= cols) or
    Y diag(f): the short side's factor is applied on the n x n side (sign_factors), a pass over the
    matrices fewer."""
    k, rows_n, cols_n = momentum.shape
    y = momentum / momentum.abs().amax(dim=(1, 2), keepdim=True).clamp_min_(TINY)
    squares = y.square()
    rows, cols = squares.sum(2, keepdim=True), squares.sum(1, keepdim=True)
    total = rows.sum(1, keepdim=True).clamp_min_(TINY)
    row_factor = torch.addcdiv(damping, rows, total, value=rows_n).pow_(-0.25)
    col_factor = torch.addcdiv(damping, cols, total, value=cols_n).pow_(-0.25)
    if rows_n <= cols_n:
        return y.mul_(col_factor), row_factor.view(k, 1, rows_n)
    return y.mul_(row_factor), col_factor


def sign_factors(preconditioned: list[tuple[torch.Tensor, torch.Tensor]],
                 size: float | torch.Tensor) -> list[torch.Tensor]:
    """For each batch's X = (Y, f) (precondition) the [k, n, n] factor L with L Y (or Y L^T where
    rows > cols) = size * msign(X) / |msign(X)|_F, msign by NS_STEPS Newton-Schulz steps from
    X / |X|_F: X <- a X + (b A + c A^2) X, A = X X^T (n = rows; the transposes else). Each step is
    Q X with Q = a + b A + c A^2 a polynomial in A, so X_k = P_k X and A_k = P_k G P_k^T (G = X X^T):
    the steps run on the small n x n side alone, P <- Q P and A <- Q A Q, every batch of the same n
    together; Y is read twice (G, then L Y), not twice a step; L = P diag(f). G squares X's
    condition number: it and the first step are float64, or a nearly low-rank momentum (a LoRA
    matrix's, often) loses its small directions (up to 1% off in float32); after one step they have
    grown a^2-fold, and float32 keeps them about as well as float32 Newton-Schulz on X itself."""
    a, b, c = NS_COEFFICIENTS
    grams = [torch.bmm(y64, y64.mT) if y64.shape[1] <= y64.shape[2] else torch.bmm(y64.mT, y64)
             for y64 in (y.double() for y, _ in preconditioned)]
    out: list[torch.Tensor | None] = [None] * len(grams)
    for n in {g.shape[1] for g in grams}:          # one run per size of the small side (the rank, mostly)
        which = [i for i, g in enumerate(grams) if g.shape[1] == n]
        sizes = [grams[i].shape[0] for i in which]
        factor = torch.cat([preconditioned[i][1] for i in which]) if len(which) > 1 else preconditioned[which[0]][1]
        gram = torch.cat([grams[i] for i in which]) if len(which) > 1 else grams[which[0]]
        factor64 = factor.double()
        gram.mul_(factor64.mT).mul_(factor64)      # G = diag(f) Y Y^T diag(f)
        squared_norm = gram.diagonal(dim1=1, dim2=2).sum(1).clamp_min_(TINY).view(-1, 1, 1)     # |X|_F^2
        a_k, p = gram / squared_norm, None
        for k in range(NS_STEPS):
            q = torch.baddbmm(a_k, a_k, a_k, beta=b, alpha=c)
            q.diagonal(dim1=1, dim2=2).add_(a)
            p = (q / squared_norm.sqrt()).float() if p is None else torch.bmm(q, p)    # P_0 = I / |X|_F
            if k < NS_STEPS - 1:                   # the last step's A is not needed
                a_k = torch.bmm(torch.bmm(q, a_k), q)
                a_k = a_k.float() if k == 0 else a_k
        # |P X|_F^2 = trace(P G P^T), in float64 too (its terms cancel); a zero matrix (no gradient
        # yet) gets no step, not 0 / 0.
        p64 = p.double()
        norm2 = (torch.bmm(p64, gram) * p64).sum((1, 2), keepdim=True)
        p.mul_(torch.where(norm2 > 0, norm2.clamp_min(TINY).rsqrt(), 0.0).mul_(size).float()).mul_(factor)
        for j, part in zip(which, p.split(sizes)):
            out[j] = part
    return out
