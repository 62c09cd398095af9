"""Decode attention over a right-padded cache in a handful of kernels.

A decode step brings one query token per sequence. The general path (pad the queries,
attend with an explicit mask, unpad) costs ~15 small kernels per layer; on a GPU each costs
a few microseconds even inside a CUDA graph, which at batch 1 is more than the layer's
matrix products take to stream their weights. Here:

- GQA without copies: the G query heads that share a kv head are laid out as G "query
  rows" of that head, q (B, Hq, D) -> (B, Hkv, G, D), a view; every kv head is read once.
- one boolean mask (B, 1, 1, S) from seq_lens (and the sliding window), and
- one fused `scaled_dot_product_attention` call (its memory-efficient kernel on a GPU).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def padded_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
    """q (B, Hq, D): each sequence's one new query, at position seq_lens[b] - 1.
    keys, values (B, Hkv, S, D): sequence b's keys at [b, :, :seq_lens[b]] (the rest masked).
    Returns (B, Hq, D). Nothing is copied to the host (CUDA-graph safe)."""
    B, Hq, D = q.shape
    Hkv, S = keys.shape[1], keys.shape[2]
    qg = q.view(B, Hkv, Hq // Hkv, D)
    k_pos = torch.arange(S, device=q.device)
    visible = k_pos[None, :] < seq_lens[:, None]  # (B, S)
    if window is not None:
        visible = visible & (k_pos[None, :] >= seq_lens[:, None] - window)
    out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=visible[:, None, None, :], scale=scale)
    return out.reshape(B, Hq, D)
