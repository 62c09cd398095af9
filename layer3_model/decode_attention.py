"""Decode attention over a right-padded cache in a handful of kernels.

A decode step brings one query token per sequence. The general path (pad the queries,
attend with an explicit mask, unpad) costs ~15 small kernels per layer; on a GPU each costs
a few microseconds even inside a CUDA graph, which at batch 1 is more than the layer's
matrix products take to stream their weights. Here:

- GQA without copies: the G query heads that share a kv head are laid out as G "query
  rows" of that head, q (B, Hq, D) -> (B, Hkv, G, D), a view; every kv head is read once.
- one additive mask (B, 1, 1, S) (0 where visible, -inf elsewhere) per *step*, not per
  layer: every layer of a step sees the same sequence lengths, so the first layer builds it
  and the others reuse it (memoised on the step's AttentionContext), and
- one fused `scaled_dot_product_attention` call.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def decode_bias(seq_lens: torch.Tensor, S: int, window: int | None, dtype: torch.dtype,
                memo: dict | None = None) -> torch.Tensor:
    """(B, 1, 1, S) additive mask: 0 for key positions < seq_lens[b] (and >= seq_lens[b] -
    window), -inf elsewhere. With `memo` (a dict living as long as one step's context), built
    once per step. Inside CUDA-graph capture the key differs, so the capture records the
    mask's own kernels and a replay recomputes it from the new seq_lens."""
    key = (S, window, dtype, torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    if memo is not None and key in memo:
        return memo[key]
    k_pos = torch.arange(S, device=seq_lens.device)
    visible = k_pos[None, :] < seq_lens[:, None]
    if window is not None:
        visible = visible & (k_pos[None, :] >= seq_lens[:, None] - window)
    bias = torch.zeros(visible.shape, dtype=dtype, device=seq_lens.device)
    bias.masked_fill_(~visible, float("-inf"))
    bias = bias[:, None, None, :]
    if memo is not None:
        memo[key] = bias
    return bias


def padded_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float, window: int | None,
                            memo: dict | None = None) -> torch.Tensor:
    """q (B, Hq, D): each sequence's one new query, at position seq_lens[b] - 1.
    keys, values (B, Hkv, S, D): sequence b's keys at [b, :, :seq_lens[b]] (the rest masked).
    Returns (B, Hq, D). Nothing is copied to the host (CUDA-graph safe)."""
    B, Hq, D = q.shape
    Hkv, S = keys.shape[1], keys.shape[2]
    qg = q.view(B, Hkv, Hq // Hkv, D)
    bias = decode_bias(seq_lens, S, window, q.dtype, memo)
    out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=bias, scale=scale)
    return out.reshape(B, Hq, D)
