"""The paged KV cache: one pool of fixed-size blocks shared by every sequence.

k and v are (layers, num_blocks + 1, block_size, kv_heads, head_dim). The block manager
hands out ids 0..num_blocks-1; the extra last block (`scratch_block`) belongs to nobody:
CUDA-graph padding rows write into it and attend over it, so they never touch a real block.
Token position p of a sequence lives at flat slot

    slot = block_table[p // block_size] * block_size + p % block_size

so `write` is one scatter (index_copy_) over the flat (slots, kv_heads, head_dim) view, the
same as layer 3's contiguous cache, and the model code does not change. `read` gathers each
sequence's blocks into layer 3's right-padded (B, kv_heads, max_seq_len, head_dim) layout for
the general (prefill / mixed) attention path; decode steps skip that copy through
`decode_attention`, which reads the blocks in place (paged_attention.py's kernel).

Zero-initialised: attention multiplies masked slots by a probability of exactly 0, and
0 * NaN (uninitialised memory) would poison the output.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

import layer3_model as l3

from .paged_attention import paged_decode_attention

CPU_DEFAULT_KV_BYTES = 512 * 2**20  # on a CPU, with no budget given: 512 MiB of KV


def bytes_per_block(config: l3.ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """2 (k and v) * layers * block_size * kv_heads * head_dim * itemsize."""
    item = torch.empty((), dtype=dtype).element_size()
    per_token_layer = config.num_key_value_heads * config.head_dim * item
    return 2 * config.num_hidden_layers * block_size * per_token_layer


def blocks_for_budget(config: l3.ModelConfig, block_size: int, dtype: torch.dtype, *,
                      num_bytes: int | None = None, device: torch.device | str = "cpu",
                      gpu_memory_utilization: float = 0.85) -> int:
    """How many blocks fit: in `num_bytes`, else in gpu_memory_utilization of the GPU's
    free memory now (torch.cuda.mem_get_info: call it after the weights are loaded; the
    rest is left for activations), else CPU_DEFAULT_KV_BYTES on a CPU."""
    per_block = bytes_per_block(config, block_size, dtype)
    if num_bytes is None:
        device = torch.device(device)
        if device.type == "cuda":
            if not 0 < gpu_memory_utilization <= 1:
                raise ValueError("gpu_memory_utilization must be in (0, 1], got "
                                 f"{gpu_memory_utilization}")
            free, _ = torch.cuda.mem_get_info(device)
            num_bytes = int(free * gpu_memory_utilization)
        else:
            num_bytes = CPU_DEFAULT_KV_BYTES
    blocks = int(num_bytes) // per_block - 1  # minus the scratch block
    if blocks < 1:
        raise ValueError(f"KV cache budget of {num_bytes} bytes is too small: one block of "
                         f"{block_size} "
                         f"tokens takes {per_block} bytes (plus one scratch block)")
    return blocks


class PagedKVCache:
    """Layer 3's KVCache protocol (write / read) over blocks, plus copy_blocks for
    copy-on-write and decode_attention for decode steps."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, *,
                 dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        if min(num_layers, num_blocks, block_size, num_kv_heads, head_dim) < 1:
            raise ValueError(f"every paged-cache dimension must be >= 1, got layers={num_layers} "
                             f"blocks={num_blocks} block_size={block_size} kv_heads={num_kv_heads} "
                             f"head_dim={head_dim}")
        shape = (num_layers, num_blocks + 1, block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks, self.block_size, self.scratch_block = num_blocks, block_size, num_blocks

    @classmethod
    def for_model(cls, config: l3.ModelConfig, num_blocks: int, block_size: int, *,
                  dtype: torch.dtype,
                  device: torch.device | str | None = None) -> PagedKVCache:
        return cls(config.num_hidden_layers, num_blocks, block_size, config.num_key_value_heads,
                   config.head_dim, dtype=dtype, device=device)

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def context(self, query_lens: Sequence[int], context_lens: Sequence[int],
                block_tables: Sequence[Sequence[int]], *,
                staging: l3.HostStaging | None = None,
                table: tuple[np.ndarray, np.ndarray] | None = None) -> l3.AttentionContext:
        """AttentionContext for B sequences: sequence b's query_lens[b] new tokens sit at
        positions context_lens[b].. and its blocks are block_tables[b] (enough of them to hold
        context + query tokens). ctx.block_tables: (B, max_blocks) int64, padded with 0.
        Slots are worked out on the host with numpy, and everything goes to the device in
        one pinned, non-blocking copy (staging: the runner's reusable pinned buffers).
        table: block_tables already padded, with their lengths (the runner's mirror)."""
        if not len(query_lens) == len(context_lens) == len(block_tables):
            raise ValueError(f"{len(query_lens)} query lengths, {len(context_lens)} context "
                             "lengths and "
                             f"{len(block_tables)} block tables: need one of each per sequence")
        bs = self.block_size
        if table is not None:
            table, lens = table
        else:
            lens = np.fromiter(map(len, block_tables), dtype=np.int64, count=len(block_tables))
            table = padded_table(block_tables, lens)
        q = np.asarray(query_lens, dtype=np.int64).reshape(-1)
        c = np.asarray(context_lens, dtype=np.int64).reshape(-1)
        if q.size and (q.min() < 1 or c.min() < 0):
            raise ValueError("query lengths must be >= 1 and context lengths >= 0: "
                             f"{list(query_lens)}, {list(context_lens)}")
        short = np.flatnonzero(lens * bs < q + c)
        if short.size:
            b = int(short[0])
            raise ValueError(f"block table of {lens[b]} blocks cannot hold {q[b] + c[b]} tokens")
        if q.size and q.max() == 1:  # decode: one token per sequence at position c
            return self._decode_context(c, np.asarray(table, dtype=np.int64), staging)
        rows = np.repeat(np.arange(q.size), q)
        pos = np.arange(int(q.sum())) - np.repeat(np.cumsum(q) - q, q) + np.repeat(c, q)
        slots = table[rows, pos // bs] * bs + pos % bs if q.size else np.zeros(0, np.int64)
        return l3.AttentionContext.build(query_lens, context_lens, slots, block_tables=table,
                                         device=self.device, staging=staging)

    def _decode_context(self, c: np.ndarray, table: np.ndarray,
                        staging: l3.HostStaging | None) -> l3.AttentionContext:
        """context() of a decode step (B sequences, one new token each at position c[b];
        table (B, n) padded): what AttentionContext.build makes of it, every index array
        written straight into one host array and sent in one copy (a decode step pays this
        every step: no temporaries to concatenate, nothing worked out for one-token queries;
        seq_ids are query_start_loc's first B, 0..B-1 both)."""
        B, n = table.shape
        bs = self.block_size
        flat = np.empty(6 * B + 1 + B * n, dtype=np.int64)
        # positions | query_start_loc (B + 1) | query_offsets | query_lens | seq_lens | slots
        flat[:B] = c
        flat[B:2 * B + 1] = np.arange(B + 1)
        flat[2 * B + 1:3 * B + 1] = 0
        flat[3 * B + 1:4 * B + 1] = 1
        seq_lens = np.add(c, 1, out=flat[4 * B + 1:5 * B + 1])
        block = table[flat[B:2 * B], c // bs]  # the block each new token goes to
        np.add(block * bs, c % bs, out=flat[5 * B + 1:6 * B + 1])
        flat[6 * B + 1:].reshape(B, n)[:] = table
        if staging is not None:  # pinned, reused, non-blocking
            on_device = staging.to_device(flat)
        elif self.device.type == "cuda":
            on_device = torch.from_numpy(flat).pin_memory().to(self.device, non_blocking=True)
        else:
            on_device = torch.from_numpy(flat)
        views = on_device.split_with_sizes([B, B + 1, B, B, B, B, B * n])
        seq_lens_host = tuple(seq_lens.tolist())
        return l3.AttentionContext(
            positions=views[0], slot_mapping=views[5], seq_ids=views[1][:B],
            query_offsets=views[2], query_start_loc=views[1], query_lens=views[3],
            seq_lens=views[4], max_query_len=1, max_seq_len=max(seq_lens_host),
            query_lens_host=(1,) * B, seq_lens_host=seq_lens_host,
            block_tables=views[6].view(B, n))

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, ctx: l3.AttentionContext) -> None:
        """k, v (T, kv_heads, head_dim) -> their slots (ctx.slot_mapping), one scatter each."""
        self.k[layer].view(-1, *k.shape[1:]).index_copy_(0, ctx.slot_mapping, k)
        self.v[layer].view(-1, *v.shape[1:]).index_copy_(0, ctx.slot_mapping, v)

    def slot_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's k and v as flat (slots, kv_heads, head_dim) views (what `write`
        scatters into): layer 3's fused decode writes rotated k and v there in one kernel."""
        k, v = self.k[layer], self.v[layer]
        return k.view(-1, *k.shape[-2:]), v.view(-1, *v.shape[-2:])

    def block_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's k and v as (blocks, block_size, kv_heads, head_dim), the blocks that
        ctx.block_tables name: layer 3's prefill attention reads keys through them in place."""
        return self.k[layer], self.v[layer]

    def read(self, layer: int, ctx: l3.AttentionContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather every sequence's blocks: two (B, kv_heads, max_seq_len, head_dim) tensors,
        sequence b's keys at [:seq_lens[b]] (the rest: padding blocks' contents, masked)."""
        B, n = ctx.num_seqs, ctx.max_seq_len
        tables = ctx.block_tables

        def gather(pool: torch.Tensor) -> torch.Tensor:
            blocks = pool[layer][tables]  # (B, max_blocks, block_size, kv_heads, head_dim): a copy
            return blocks.view(B, -1, *blocks.shape[3:])[:, :n].transpose(1, 2)

        return gather(self.k), gather(self.v)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: block src's contents (every layer, k and v) into block dst."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    def decode_attention(self, layer: int, q: torch.Tensor, ctx: l3.AttentionContext, scale: float,
                         window: int | None) -> torch.Tensor:
        """Decode step (one new token per sequence, already written): q (B, Hq, D) ->
        (B, Hq, D), reading keys through the block tables without gathering a padded copy
        (paged_attention.py: a Triton kernel on CUDA tensors, its torch reference on a CPU)."""
        return paged_decode_attention(q, self.k[layer], self.v[layer], ctx.block_tables,
                                      ctx.seq_lens,
                                      scale, window)


def padded_table(rows: Sequence[Sequence[int]], lens: np.ndarray | None = None) -> np.ndarray:
    """Block tables of different lengths -> one (B, longest) int64 array padded with 0.
    Built through numpy in one pass (a step of 256 sequences pays this every step: a list of
    padded Python lists costs ~5x more). lens: the rows' lengths, if already known."""
    if lens is None:
        lens = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    table = np.zeros((len(rows), int(lens.max(initial=0))), dtype=np.int64)
    table[np.arange(table.shape[1])[None, :] < lens[:, None]] = np.fromiter(
        itertools.chain.from_iterable(rows), dtype=np.int64, count=int(lens.sum()))
    return table
