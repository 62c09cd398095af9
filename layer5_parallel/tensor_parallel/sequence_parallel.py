"""Sequence parallelism as in Megatron-SP (Korthikanti et al., 2022), on an RMSNorm + MLP block.

Tensor parallelism splits the matmuls but leaves the norms, residual adds and dropout
replicated: every rank holds the whole (S, D) activation there, and those are most of the
activation memory a training step keeps. Megatron-SP splits them along the sequence instead:
rank r holds rows [a_r, b_r) of the sequence in the norm and the residual, and the tensor-
parallel all-reduce becomes its two halves, placed where the layout changes:

    x_r (n_r, D) -> RMSNorm -> all-gather (S, D) -> column-parallel W_gate, W_up (F/N each)
      -> SwiGLU -> row-parallel W_down (partial sums, (S, D)) -> reduce-scatter -> + x_r

g (the all-reduce after the row-parallel linear) = reduce-scatter + all-gather; SP keeps the
reduce-scatter there and moves the all-gather in front of the next column-parallel linear, so
the bytes moved are those of TP's one all-reduce, and the norm runs on 1/N of the rows. In
backward each swaps with its conjugate (all-gather <-> reduce-scatter). The norm's weight
sees only this rank's rows, so its gradient is summed over ranks (`all_reduce_grads`).

Rows are split contiguously, sizes differing by at most one (any S). Layer 2's ring
collectives move equal-sized pieces, so uneven shards are padded to the largest and trimmed.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import layer4_algorithms as engine

comm = engine.comm


def _rows(total: int) -> list[tuple[int, int]]:
    return comm.segment_bounds(total, comm.world_size())


def gather_rows(x: torch.Tensor, total: int) -> torch.Tensor:
    """All-gather this rank's rows (n_r, D) into the whole (total, D), padded ring all-gather."""
    bounds = _rows(total)
    width = max(b - a for a, b in bounds)
    padded = x.new_zeros((width, *x.shape[1:]))
    padded[: x.shape[0]] = x
    every = comm.ring_all_gather(padded).view(len(bounds), width, *x.shape[1:])
    return torch.cat([every[r, : b - a] for r, (a, b) in enumerate(bounds)])


def reduce_scatter_rows(x: torch.Tensor) -> torch.Tensor:
    """Sum (total, D) partial results over ranks; return this rank's rows (n_r, D)."""
    bounds, me = _rows(x.shape[0]), comm.rank()
    width = max(b - a for a, b in bounds)
    padded = x.new_zeros((len(bounds), width, *x.shape[1:]))  # rank r's rows at block r
    for r, (a, b) in enumerate(bounds):
        padded[r, : b - a] = x[a:b]
    mine = comm.ring_reduce_scatter(padded)  # segment r of the flat tensor = block r
    a, b = bounds[me]
    return mine.view(width, *x.shape[1:])[: b - a]


class _GatherFromSequence(torch.autograd.Function):
    """forward: all-gather rows; backward: reduce-scatter the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, total: int) -> torch.Tensor:
        return gather_rows(x, total)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return reduce_scatter_rows(grad.contiguous()), None


class _ReduceScatterToSequence(torch.autograd.Function):
    """forward: reduce-scatter rows; backward: all-gather the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.total = x.shape[0]
        return reduce_scatter_rows(x.contiguous())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return gather_rows(grad.contiguous(), ctx.total)


def mlp_block(x: torch.Tensor, norm_w: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
              w_down: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The unsharded block: x (S, D) -> x + W_down(silu(W_gate h) * W_up h), h = RMSNorm(x)."""
    h = F.rms_norm(x, (x.shape[-1],), norm_w, eps)
    return x + (F.silu(h @ w_gate.T) * (h @ w_up.T)) @ w_down.T


class SequenceParallelMLP(nn.Module):
    """This rank's share of `mlp_block`'s weights: the norm (replicated), rows [f0, f1) of
    W_gate and W_up (F, D), columns [f0, f1) of W_down (D, F).

    forward(x_r (n_r, D), seq_len) -> (n_r, D): this rank's rows of the block's output.
    """

    def __init__(self, norm_w: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                 w_down: torch.Tensor, eps: float = 1e-6) -> None:
        super().__init__()
        me, p = comm.rank(), comm.world_size()
        ffn = w_gate.shape[0]
        if ffn < p:
            raise ValueError(f"the MLP's {ffn} hidden units cannot be split over {p} ranks "
                             f"(valid sizes: 1..{ffn})")
        f0, f1 = comm.segment_bounds(ffn, p)[me]
        self.norm_w = nn.Parameter(norm_w.detach().clone())
        self.w_gate = nn.Parameter(w_gate.detach()[f0:f1].clone())
        self.w_up = nn.Parameter(w_up.detach()[f0:f1].clone())
        self.w_down = nn.Parameter(w_down.detach()[:, f0:f1].clone())
        self.eps = eps

    def forward(self, x: torch.Tensor, seq_len: int) -> torch.Tensor:
        a, b = _rows(seq_len)[comm.rank()]
        if x.dim() != 2 or x.shape[0] != b - a:
            raise ValueError(f"rank {comm.rank()} holds rows [{a}, {b}) of {seq_len}: expected "
                             f"({b - a}, D), got {tuple(x.shape)}")
        h = F.rms_norm(x, (x.shape[-1],), self.norm_w, self.eps)  # on n_r rows only
        full = _GatherFromSequence.apply(h, seq_len)  # (S, D)
        act = F.silu(full @ self.w_gate.T) * (full @ self.w_up.T)  # (S, F/N)
        return x + _ReduceScatterToSequence.apply(act @ self.w_down.T)  # partial (S, D) -> rows

    def all_reduce_grads(self) -> None:
        """Sum the norm weight's gradient over ranks (each saw only its own rows)."""
        if self.norm_w.grad is not None:
            comm.ring_all_reduce(self.norm_w.grad)
