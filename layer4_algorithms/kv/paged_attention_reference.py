"""The paged decode kernel's companions: its argument checks, its torch reference (gather
the blocks, mask, softmax) and its cost model (`decode_bytes_and_flops`), without Triton.
Shapes as in paged_attention.py: q (B, Hq, D); k_cache, v_cache (num_blocks, block_size, Hkv,
D); block_tables (B, max_blocks); seq_lens (B,) -> (B, Hq, D)."""
from __future__ import annotations

import torch

_INDEX_DTYPES = (torch.int32, torch.int64)


def _check(q, k_cache, v_cache, block_tables, seq_lens, scale, window) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be 3-D (B, Hq, D); got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be (num_blocks, block_size, Hkv, D); got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    B, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    if k_cache.shape[3] != D:
        raise ValueError(f"q's head dim {D} differs from the cache's {k_cache.shape[3]}")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of kv heads ({Hkv})")
    if block_tables.dim() != 2 or block_tables.shape[0] != B:
        raise ValueError(f"block_tables must be (B={B}, max_blocks); got "
                         f"{tuple(block_tables.shape)}")
    if seq_lens.shape != (B,):
        raise ValueError(f"seq_lens must be (B={B},); got {tuple(seq_lens.shape)}")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        if t.dtype not in _INDEX_DTYPES:
            raise ValueError(f"{name} must be int32 or int64; got {t.dtype}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q, k_cache, v_cache dtypes differ: {q.dtype}, {k_cache.dtype}, "
                         f"{v_cache.dtype}")
    devices = {t.device for t in (q, k_cache, v_cache, block_tables, seq_lens)}
    if len(devices) != 1:
        raise ValueError("q, caches, block_tables and seq_lens must share a device; got "
                         f"{sorted(map(str, devices))}")
    if not scale > 0:  # the running max assumes scaling keeps the order of the scores
        raise ValueError(f"scale must be positive; got {scale}")
    if window is not None and window < 1:
        raise ValueError(f"window must be None or >= 1; got {window}")


def paged_decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                     block_tables: torch.Tensor, seq_lens: torch.Tensor,
                                     scale: float,
                                     window: int | None = None) -> torch.Tensor:
    """Gather every sequence's blocks into a padded (B, max_blocks * block_size, Hkv, D) copy,
    mask, softmax in fp32 (fp64 stays fp64). Same arguments and result as
    paged_decode_attention; no host sync, so it can be graph-captured too."""
    _check(q, k_cache, v_cache, block_tables, seq_lens, scale, window)
    B, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    acc = torch.promote_types(q.dtype, torch.float32)
    keys = k_cache[block_tables.long()].reshape(B, -1, Hkv, D).to(acc)  # (B, L, Hkv, D)
    values = v_cache[block_tables.long()].reshape(B, -1, Hkv, D).to(acc)
    pos = torch.arange(keys.shape[1], device=q.device)[None, :]
    n = seq_lens.long()[:, None]
    visible = pos < n
    if window is not None:
        visible = visible & (pos >= n - window)
    values = values.masked_fill(~visible[:, :, None, None], 0.0)  # unwritten slots: 0 * NaN is NaN
    scores = torch.einsum("bhgd,blhd->bhgl", q.to(acc).view(B, Hkv, Hq // Hkv, D), keys) * scale
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1)
    p = torch.where(visible.any(-1)[:, None, None, None], p, 0.0)  # a sequence with no key -> 0
    return torch.einsum("bhgl,blhd->bhgd", p, values).reshape(B, Hq, D).to(q.dtype)


def decode_bytes_and_flops(batch: int, context: int, q_heads: int, kv_heads: int, head_dim: int,
                           itemsize: int, window: int | None = None) -> tuple[int, int]:
    """The fewest bytes a decode attention call must move, and its FLOPs (see the docstring),
    with every sequence at `context` tokens (the block table's bytes are left out: < 0.1 %)."""
    visible = context if window is None else min(context, window)
    q_and_out = 2 * batch * q_heads * head_dim * itemsize
    bytes_ = q_and_out + 2 * batch * visible * kv_heads * head_dim * itemsize
    return bytes_, 4 * batch * visible * q_heads * head_dim

