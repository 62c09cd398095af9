"""A paged KV cache with known contents, for the paged-attention tests of layer 1 (the decode
kernel) and layer 4 (the attention the engine runs)."""
from __future__ import annotations

import math

import torch


def make_case(seq_lens: list[int], q_heads: int, kv_heads: int, head_dim: int, block_size: int, *,
              window: int | None = None, dtype: torch.dtype = torch.float32, device: str = "cpu",
              seed: int = 0, table_dtype: torch.dtype = torch.int64, spare_blocks: int = 3) -> dict:
    """A paged cache holding `seq_lens[b]` tokens of each sequence in shuffled blocks, NaN in
    every slot the queries must not see, block tables padded to the longest sequence."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [math.ceil(n / block_size) for n in seq_lens]
    width = max(max(per_seq), 1)
    num_blocks = sum(per_seq) + spare_blocks
    ids = torch.randperm(num_blocks, generator=gen)
    pad_block = int(ids[-1])  # never holds a real token: table padding points at NaNs
    tables = torch.full((len(seq_lens), width), pad_block, dtype=torch.int64)
    k = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"))
    v = torch.full_like(k, float("nan"))
    used = 0
    for b, (n, blocks) in enumerate(zip(seq_lens, per_seq, strict=True)):
        tables[b, :blocks] = ids[used:used + blocks]
        used += blocks
        lo = 0 if window is None else max(0, n - window)
        j = torch.arange(lo, n)  # only the visible tokens are written
        blk, row = tables[b, j // block_size], j % block_size
        k[blk, row] = torch.randn(len(j), kv_heads, head_dim, generator=gen)
        v[blk, row] = torch.randn(len(j), kv_heads, head_dim, generator=gen)
    q = torch.randn(len(seq_lens), q_heads, head_dim, generator=gen)
    return dict(q=q.to(device, dtype), k_cache=k.to(device, dtype), v_cache=v.to(device, dtype),
                block_tables=tables.to(device, table_dtype),
                seq_lens=torch.tensor(seq_lens, dtype=table_dtype, device=device),
                scale=1.0 / math.sqrt(head_dim), window=window)
