"""Megatron's f and g, and the column- and row-parallel linears built on them (lab 5, exercise 1).

A linear y = x W^T with W (D_out, D_in) splits over N ranks two ways:
* column-parallel: rank r holds rows r of W (D_out/N outputs each); every rank needs all of
  x and produces its slice of y. No communication forward.
* row-parallel: rank r holds columns r of W (D_in/N inputs each) and its slice of x; each
  rank's x_r W_r^T is a partial sum of y: one all-reduce forward.
An MLP is column then row: the column's output slice is exactly the row's input slice, so the
pair needs one all-reduce forward and, by symmetry, one backward:

    f = copy_to_tp_region:      forward identity,   backward all-reduce (sum of the ranks' dx)
    g = reduce_from_tp_region:  forward all-reduce, backward identity

f sits where a replicated x enters the column-parallel linear: each rank's backward gives only
its slice's contribution to dL/dx, and x's gradient is their sum. g sits after the row-parallel
linear. Bias: a column-parallel bias is sharded like its outputs; a row-parallel bias is added
once, after g (added before, it would be summed N times).

The all-reduce here is layer 2's ring (`engine.comm.ring_all_reduce`), in place on a copy.
"""
from __future__ import annotations

import torch

import layer4_algorithms as engine

comm = engine.comm


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    return comm.ring_all_reduce(x.detach().clone().contiguous(), "sum")


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return _all_reduce(grad)


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return _all_reduce(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def copy_to_tp_region(x: torch.Tensor) -> torch.Tensor:
    """f: x unchanged forward; in backward the gradient is summed over the ranks."""
    return _CopyToTP.apply(x)


def reduce_from_tp_region(x: torch.Tensor) -> torch.Tensor:
    """g: the sum of x over the ranks forward; the gradient passes unchanged backward."""
    return _ReduceFromTP.apply(x)


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., D_in), the same on every rank; weight (D_out_r, D_in), this rank's rows of W;
    bias (D_out_r,) or None -> (..., D_out_r), this rank's slice of x W^T + b."""
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"column_parallel_linear: x {tuple(x.shape)} and weight shard "
                         f"{tuple(weight.shape)} do not fit (need x[..., D_in], weight[:, D_in])")
    y = copy_to_tp_region(x) @ weight.T
    return y if bias is None else y + bias


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., D_in_r), this rank's slice; weight (D_out, D_in_r), this rank's columns of W;
    bias (D_out,) or None, the same on every rank -> (..., D_out) = x W^T + b on every rank."""
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"row_parallel_linear: x shard {tuple(x.shape)} and weight shard "
                         f"{tuple(weight.shape)} do not fit "
                         "(need x[..., D_in_r], weight[:, D_in_r])")
    y = reduce_from_tp_region(x @ weight.T)
    return y if bias is None else y + bias
