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
batch is a handful of batched ops rather than a few dozen ops per matrix. The momentum lives in one
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
        self._batches = list(by_shape.values())
        return self._batches

    @torch.no_grad()
    def step(self, closure=None):
        group = self.param_groups[0]
        found_inf = getattr(self, "found_inf", None)
        correction = (self.rank / RANK_REFERENCE) ** -group["rank_lr_correction_exponent"]
        size = group["lr"] * correction * math.sqrt(self.rank)     # each matrix's step, Frobenius
        if found_inf is None:
            weight, size = 1 - group["beta1"], torch.tensor(size)
        else:       # a skipped step: the momentum keeps its value (lerp by 0), the weights theirs
            keep = 1 - found_inf.float()
            weight, size = (1 - group["beta1"]) * keep, size * keep
        for batch in self._batched():
            grads = torch.stack([_grad(p).mT if flip else _grad(p) for p, flip in zip(batch.params, batch.transposed)])
            if found_inf is not None:
                grads.nan_to_num_(0.0, 0.0, 0.0)
            batch.momentum.lerp_(grads, weight)
            direction = matrix_sign(precondition(batch.momentum, group["damping"]))
            norms = torch.linalg.matrix_norm(direction).clamp_min(TINY)
            direction.mul_((size.to(direction.device) / norms).view(-1, 1, 1))
            targets = [p.mT if flip else p for p, flip in zip(batch.params, batch.transposed)]
            torch._foreach_sub_(targets, [d.to(t.dtype) for d, t in zip(direction.unbind(0), targets)])
        return None


def _grad(p: torch.nn.Parameter) -> torch.Tensor:
    return p.grad.float() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32)


def precondition(momentum: torch.Tensor, damping: float) -> torch.Tensor:
    """diag(r + damping)^(-1/4) M diag(c + damping)^(-1/4) for a batch [k, rows, cols], with r and
    c each row's and column's mean square relative to the matrix's (module doc). Scaled by each
    matrix's largest entry first, so that squares neither overflow nor vanish."""
    scale = momentum.abs().amax(dim=(1, 2), keepdim=True).clamp_min(TINY)
    m = momentum / scale
    squares = m.square()
    rows, cols = squares.mean(2, keepdim=True), squares.mean(1, keepdim=True)
    mean = rows.mean(1, keepdim=True).clamp_min(TINY)
    return m * ((rows / mean + damping) ** -0.25) * ((cols / mean + damping) ** -0.25)


def matrix_sign(x: torch.Tensor) -> torch.Tensor:
    """msign(x) = U V^T of x's SVD, approximately, for a batch [k, rows, cols] with rows <= cols:
    normalized so that every singular value is at most 1, then NS_STEPS Newton-Schulz steps
    X <- a X + (b A + c A^2) X, A = X X^T (rows x rows: the small side)."""
    a, b, c = NS_COEFFICIENTS
    x = x / torch.linalg.matrix_norm(x).clamp_min(TINY).view(-1, 1, 1)
    for _ in range(NS_STEPS):
        gram = torch.bmm(x, x.mT)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    return x
