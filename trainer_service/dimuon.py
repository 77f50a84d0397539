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

The matrices are stepped in batches of one shape each: every LoRA matrix is oriented with its rank
side first (b transposed), so a model has a few shapes (one per distinct layer width), and each
batch is a handful of batched ops rather than a few dozen ops per matrix. The Newton-Schulz steps
run on the small rank x rank side (sign_factors), all batches together. The momentum lives in one
buffer per shape; each parameter's state["momentum"] is a view of its slice, in the parameter's
own orientation (what a checkpoint saves, and loads back: load_state_dict rebuilds the buffers).

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


@dataclasses.dataclass
class _Batch:
    params: list[torch.nn.Parameter]
    transposed: list[bool]           # stored as (rank side, other side): b is transposed
    momentum: torch.Tensor           # [len(params), rows, cols]
    targets: list[torch.Tensor] = dataclasses.field(default_factory=list)   # the params, oriented as momentum


class Dimuon(torch.optim.Optimizer):
    """`params`: one adapter's LoRA matrices, all of LoRA rank `rank`. The per-step settings are
    the param group's (training.py sets them from each request): lr, beta1, damping,
    rank_lr_correction_exponent. A `found_inf` attribute (a 0-d tensor, as torch's GradScaler
    sets on its optimizers) makes the step a no-op where it is 1, decided on the device."""

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
        """The matrices by oriented shape, in parameter order, each batch's momentum one buffer
        (holding what state["momentum"] held, zeros where none) and the state views of it."""
        if self._batches is not None:
            return self._batches
        by_shape: dict[tuple[int, int], _Batch] = {}
        for p in self.param_groups[0]["params"]:
            flip = p.shape[0] > p.shape[1]
            shape = (p.shape[1], p.shape[0]) if flip else tuple(p.shape)
            batch = by_shape.setdefault(shape, _Batch([], [], torch.empty(0)))
            batch.params.append(p)
            batch.transposed.append(flip)
        for batch in by_shape.values():
            momenta = []
            for p, flip in zip(batch.params, batch.transposed):
                m = self.state[p].get("momentum")
                m = torch.zeros_like(p, dtype=torch.float32) if m is None else m.to(p.device, torch.float32)
                momenta.append(m.mT if flip else m)
            batch.momentum = torch.stack(momenta)
            for k, (p, flip) in enumerate(zip(batch.params, batch.transposed)):
                self.state[p]["momentum"] = batch.momentum[k].mT if flip else batch.momentum[k]
            batch.targets = [p.mT if flip else p for p, flip in zip(batch.params, batch.transposed)]
        self._batches = list(by_shape.values())
        return self._batches

    @torch.no_grad()
    def step(self, closure=None):
        group = self.param_groups[0]
        found_inf = getattr(self, "found_inf", None)
        correction = (self.rank / RANK_REFERENCE) ** -group["rank_lr_correction_exponent"]
        size = group["lr"] * correction * math.sqrt(self.rank)     # each matrix's step, Frobenius
        weight = 1 - group["beta1"]
        if found_inf is not None:       # a skipped step: the momentum keeps its value (lerp by 0), the weights theirs
            keep = 1 - found_inf.float()
            weight, size = weight * keep, size * keep
        batches = self._batched()
        preconditioned = []
        for batch in batches:
            grads = torch.stack([_grad(p, flip) for p, flip in zip(batch.params, batch.transposed)]).float()
            if found_inf is not None:
                grads.nan_to_num_(0.0, 0.0, 0.0)
            batch.momentum.lerp_(grads, weight)
            preconditioned.append(precondition(batch.momentum, group["damping"]))
        for batch, x, left in zip(batches, preconditioned, sign_factors(preconditioned, size)):
            moves = torch.bmm(left, x).to(batch.targets[0].dtype).unbind(0)
            torch._foreach_sub_(batch.targets, moves)
        return None


def _grad(p: torch.nn.Parameter, flip: bool) -> torch.Tensor:
    g = p.grad if p.grad is not None else torch.zeros_like(p)
    return g.mT if flip else g


def precondition(momentum: torch.Tensor, damping: float) -> torch.Tensor:
    """diag(r + damping)^(-1/4) M diag(c + damping)^(-1/4) for a batch [k, rows, cols], with r and
    c each row's and column's mean square relative to the matrix's (module doc). Scaled by each
    matrix's largest entry first, so that squares neither overflow nor vanish."""
    m = momentum / momentum.abs().amax(dim=(1, 2), keepdim=True).clamp_min(TINY)
    squares = m.square()
    rows, cols = squares.mean(2, keepdim=True), squares.mean(1, keepdim=True)
    mean = rows.mean(1, keepdim=True).clamp_min(TINY)
    return m.mul_(rows.div_(mean).add_(damping).pow_(-0.25)).mul_(cols.div_(mean).add_(damping).pow_(-0.25))


def sign_factors(xs: list[torch.Tensor], size: float | torch.Tensor) -> list[torch.Tensor]:
    """For each batch x [k, rows, cols] (rows <= cols) the [k, rows, rows] factor P with P x =
    size * msign(x) / |msign(x)|_F, msign by NS_STEPS Newton-Schulz steps from x / |x|_F:
    X <- a X + (b A + c A^2) X, A = X X^T. Each step is Q X with Q = a + b A + c A^2 a polynomial
    in A, so X_k = P_k X and A_k = P_k G P_k^T (G = x x^T): the steps run on the small rows x rows
    side alone, P <- Q P and A <- Q A Q, every batch of the same rows together; x is read twice
    (G, then P x), not twice a step. G squares x's condition number: it and the first step are
    float64, or a nearly low-rank momentum (a LoRA matrix's, often) loses its small directions
    (up to 1% off in float32); after one step they have grown a^2-fold, and float32 keeps them
    about as well as float32 Newton-Schulz on x itself does."""
    a, b, c = NS_COEFFICIENTS
    grams = [torch.bmm(x64, x64.mT) for x64 in (x.double() for x in xs)]
    out: list[torch.Tensor | None] = [None] * len(xs)
    for rows in {g.shape[1] for g in grams}:       # one run per size of the small side (the rank, mostly)
        which = [i for i, g in enumerate(grams) if g.shape[1] == rows]
        gram = torch.cat([grams[i] for i in which])
        squared_norm = gram.diagonal(dim1=1, dim2=2).sum(1).clamp_min(TINY).view(-1, 1, 1)     # |x|_F^2
        a_k = gram / squared_norm
        for k in range(NS_STEPS):
            q = torch.baddbmm(a_k, a_k, a_k, beta=b, alpha=c)
            q.diagonal(dim1=1, dim2=2).add_(a)
            p = (q / squared_norm.sqrt()).float() if k == 0 else torch.bmm(q, p)    # P_0 = I / |x|_F
            if k < NS_STEPS - 1:                   # the last step's A is not needed
                a_k = torch.bmm(torch.bmm(q, a_k), q).float()
        # |P x|_F^2 = trace(P G P^T), in float64 too (its terms cancel); a zero matrix (no gradient
        # yet) gets no step, not 0 / 0.
        p64 = p.double()
        norm2 = (torch.bmm(p64, gram) * p64).sum((1, 2)).view(-1, 1, 1)
        p = p * torch.where(norm2 > 0, norm2.clamp_min(TINY).rsqrt(), 0.0).float()
        for j, part in zip(which, p.split([grams[i].shape[0] for i in which])):
            out[j] = part.to(xs[j].dtype) * size
    return out
