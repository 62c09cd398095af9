"""Lab 5 — parallelism: your answers.

Two exercises, in the order `lab5.ipynb` teaches them:

1. Megatron's tensor-parallel linears, forward AND backward, on real ranks (gloo, this CPU):
   `copy_to_tp_region` (f) and `reduce_from_tp_region` (g) as torch.autograd.Functions, then
   `column_parallel_linear` and `row_parallel_linear` built on them.
2. Ring attention's step: `attention_block` (one block of keys -> a partial output and its
   log-sum-exp) and `merge_partial` (fold that block into the running output, exactly).

Write the code where it says YOUR CODE (each raises NotImplementedError until you do). Keep
the names and signatures: the grader calls them. Grade yourself with `stack grade --lab 5`.

Rules the grader enforces (see tests/labs/test_lab5.py):
* Plain Python and PyTorch. For exercise 1 use torch.distributed's collectives
  (`dist.all_reduce(t)` sums t over the ranks, in place); the grader starts the ranks and the
  process group for you (gloo, 2 ranks; odd sizes, so shards are uneven).
* Do not import `layer5_parallel`: it holds the answers, and the grader refuses a file that
  imports it. torch.nn.functional.scaled_dot_product_attention is fine to check your work
  in the notebook, but attention_block must return the log-sum-exp too, which it does not.
* Gradients are checked against one process computing the whole layer: every weight shard's
  gradient, the input's (after f), and the bias's.
"""
from __future__ import annotations

import math  # noqa: F401  (for your attention_block)

import torch
import torch.distributed as dist  # noqa: F401  (for your f and g)


# ---- Exercise 1: Megatron's f and g, column- and row-parallel linears --------------------------
class CopyToTP(torch.autograd.Function):
    """f: forward returns x unchanged; backward returns the gradient summed over all ranks."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("YOUR CODE: f's forward")

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("YOUR CODE: f's backward (an all-reduce)")


class ReduceFromTP(torch.autograd.Function):
    """g: forward returns x summed over all ranks; backward returns the gradient unchanged."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("YOUR CODE: g's forward (an all-reduce; do not modify x itself)")

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("YOUR CODE: g's backward")


def copy_to_tp_region(x: torch.Tensor) -> torch.Tensor:
    """f: identity forward, all-reduce backward."""
    return CopyToTP.apply(x)


def reduce_from_tp_region(x: torch.Tensor) -> torch.Tensor:
    """g: all-reduce forward, identity backward."""
    return ReduceFromTP.apply(x)


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., D_in), the same on every rank; weight (D_out_r, D_in), this rank's rows of the
    full W (D_out, D_in); bias (D_out_r,) or None.
    Returns (..., D_out_r): this rank's slice of x W^T + b. x's gradient must come out whole
    (the sum of every rank's contribution): that is what f is for."""
    raise NotImplementedError("YOUR CODE: column-parallel linear")


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., D_in_r), this rank's slice of the input; weight (D_out, D_in_r), this rank's
    columns of W; bias (D_out,) or None, the same on every rank.
    Returns (..., D_out) = x_full W^T + b, the same on every rank. Add the bias once."""
    raise NotImplementedError("YOUR CODE: row-parallel linear")


# ---- Exercise 2: ring attention's step --------------------------------------------------------
def attention_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                    k_pos: torch.Tensor, scale: float | None = None,
                    causal: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over one block of keys, unnormalised across blocks.

    q (B, H, n, D); k (B, Hkv, m, D); v (B, Hkv, m, Dv). H is a multiple of Hkv (GQA: query
    head h uses kv head h // (H // Hkv)). q_pos (n,), k_pos (m,): global positions; with
    causal=True query i may see key j only if k_pos[j] <= q_pos[i]. scale defaults to
    1/sqrt(D).
    Returns (out (B, H, n, Dv) float32, lse (B, H, n) float32): softmax over this block's
    visible keys times v, and the log-sum-exp of the visible scaled scores. A query that sees
    no key of the block gets out = 0 and lse = -inf (and never NaN).
    """
    raise NotImplementedError("YOUR CODE: one block's partial attention and its log-sum-exp")


def merge_partial(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
                  block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold a block's (block_out, block_lse) into the running (out, lse); shapes (..., n, Dv)
    and (..., n). Returns the merged (out, lse): exactly the attention over the keys of both.
    -inf in lse means "no keys yet" (out is 0 there); two -inf merge to out 0, lse -inf."""
    raise NotImplementedError("YOUR CODE: the log-sum-exp merge")
