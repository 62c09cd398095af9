"""The seam between the model and whoever owns the KV cache (this layer now, layer 4 later).

The model works on a flat list of new tokens from several sequences at once, vLLM style:
hidden states are (T, hidden) with T = the sum of every sequence's new tokens. No pad
token ever goes through a matmul. What attention needs to know about that list travels
in one small object, the `AttentionContext`, built once per step and read by every layer:

    tokens of a batch:  [ seq 0: 5 prompt tokens | seq 1: 3 prompt tokens ]      (prefill)
                        [ seq 0: 1 new token     | seq 1: 1 new token     ]      (decode)
    positions           where each token sits in its sequence (RoPE angle, causal mask)
    query_lens          new tokens per sequence;  seq_lens = context + new tokens
    slot_mapping        where each new token's k and v go in the cache (a flat slot index)
    block_tables        which cache blocks hold each sequence (layer 4's paged cache;
                        for the contiguous cache a "block" is a whole row)

Attention writes this step's k, v through `cache.write(layer, k, v, ctx)` and reads every
key of every sequence back through `cache.read(layer, ctx)`, as (B, kv_heads, max_seq_len,
head_dim) right-padded tensors: sequence b's keys are at [b, :, :seq_lens[b]] and the rest
is masked out. A mixed batch (one sequence prefilling, others decoding) is the same
object with different query_lens, so layer 4 can bring paged caches, continuous batching
and chunked prefill without touching the model code.

A cache may also bring its own decode kernel: when every sequence brings one new token
(`ctx.max_query_len == 1`) and the cache has a `decode_attention(layer, q, ctx, scale,
window)` method, attention calls it instead of `read` + padded attention (after `write`,
so the new token's k, v are already in the cache). ContiguousKVCache does (one SDPA call,
decode_attention.py), and so does layer 4's paged cache: its kernel reads keys through the
block tables in place instead of gathering them into a padded copy.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from .decode_attention import padded_decode_attention


@dataclass
class AttentionContext:
    """Attention metadata for one forward step over B sequences and T = sum(query_lens) tokens.

    Device tensors (int64): positions, slot_mapping, seq_ids, query_offsets (T,);
    query_start_loc (B+1,) (cumulative query_lens: sequence b's tokens are
    [query_start_loc[b], query_start_loc[b+1]) of the flat batch); query_lens, seq_lens (B,);
    block_tables (B, max_blocks) or None. Host ints size the padded tensors, so no step
    needs a device-to-host copy (which also keeps the decode step capturable in a CUDA graph).
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_ids: torch.Tensor  # which sequence (row of the batch) each token belongs to
    query_offsets: torch.Tensor  # the token's index among its sequence's new tokens
    query_start_loc: torch.Tensor
    query_lens: torch.Tensor
    seq_lens: torch.Tensor
    max_query_len: int
    max_seq_len: int
    query_lens_host: tuple[int, ...]
    seq_lens_host: tuple[int, ...]
    block_tables: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_host)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def is_prefill(self) -> bool:
        """Every sequence starts from an empty cache: attention may use this step's k, v as is."""
        return self.query_lens_host == self.seq_lens_host

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        slot_mapping: Sequence[int] | torch.Tensor,
        *,
        block_tables: torch.Tensor | None = None,
        device: torch.device | str | None = None,
    ) -> AttentionContext:
        """Context for B sequences, sequence b bringing query_lens[b] new tokens after
        context_lens[b] tokens already in the cache. slot_mapping (T,) comes from the cache."""
        if len(query_lens) != len(context_lens) or not query_lens:
            raise ValueError(f"need one query length and one context length per sequence, got "
                             f"{len(query_lens)} and {len(context_lens)}")
        if min(query_lens) < 1 or min(context_lens) < 0:
            raise ValueError("query lengths must be >= 1 and context lengths >= 0: "
                             f"{query_lens}, {context_lens}")
        seq_lens = [q + c for q, c in zip(query_lens, context_lens, strict=True)]
        positions = [c + i for q, c in zip(query_lens, context_lens, strict=True) for i in range(q)]
        seq_ids = [b for b, q in enumerate(query_lens) for _ in range(q)]
        offsets = [i for q in query_lens for i in range(q)]
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        T = len(positions)
        is_tensor = isinstance(slot_mapping, torch.Tensor)
        shape = tuple(slot_mapping.shape) if is_tensor else (len(slot_mapping),)
        if shape != (T,):
            raise ValueError(f"slot_mapping must hold one slot per new token ({T}), got {shape}")
        # Every index list in one host tensor and one copy to the device (a decode step pays
        # this every step; seven small copies cost seven transfers), then views of it.
        host_slots = [] if is_tensor else list(slot_mapping)
        parts = (positions, seq_ids, offsets, starts, list(query_lens), seq_lens, host_slots)
        flat = torch.tensor([x for p in parts for x in p], dtype=torch.int64).to(device)
        views = flat.split([len(p) for p in parts])
        positions_t, seq_ids_t, offsets_t, starts_t, qlens_t, seq_lens_t, slots = views
        if is_tensor:
            slots = slot_mapping.to(device=device, dtype=torch.int64)

        return cls(
            positions=positions_t,
            slot_mapping=slots,
            seq_ids=seq_ids_t,
            query_offsets=offsets_t,
            query_start_loc=starts_t,
            query_lens=qlens_t,
            seq_lens=seq_lens_t,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_host=tuple(query_lens),
            seq_lens_host=tuple(seq_lens),
            block_tables=block_tables,
        )


class KVCache(Protocol):
    """What attention needs from a KV cache. Layer 4's paged cache implements the same two calls.

    Optional third method (not part of the protocol, looked up with getattr; ContiguousKVCache
    and layer 4's paged cache have it; a cache without it gets the general padded path):

        decode_attention(layer, q (B, Hq, D), ctx, scale, window) -> (B, Hq, D)

    called instead of `read` + attention on steps with ctx.max_query_len == 1 (q's row b is
    sequence b's one new token, whose k, v `write` has already stored). It must give what
    `read` + masked attention would (keys at positions < seq_lens[b], and > position - window
    with a sliding window) and must not copy to the host (the decode step is graph-captured).
    """

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext) -> None:
        """Store this step's k, v (T, kv_heads, head_dim) at ctx.slot_mapping."""
        ...

    def read(self, layer: int, ctx: AttentionContext) -> tuple[torch.Tensor, torch.Tensor]:
        """All keys and values of the batch's sequences: two (B, kv_heads, ctx.max_seq_len,
        head_dim) tensors, sequence b's first seq_lens[b] positions valid (the rest masked)."""
        ...


class ContiguousKVCache:
    """One row of max_len slots per sequence: k and v are (layers, batch, max_len, kv_heads,
    head_dim). Slot of (row r, position p) = r * max_len + p. Zero-initialised, so masked
    slots hold finite numbers (0 * NaN would poison the output through the softmax @ v).

    Size: 2 (k and v) * layers * batch * max_len * kv_heads * head_dim * itemsize bytes.
    """

    def __init__(
        self,
        num_layers: int,
        batch: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        if min(num_layers, batch, max_len, num_kv_heads, head_dim) < 1:
            raise ValueError("every KV cache dimension must be >= 1, got "
                             f"layers={num_layers} batch={batch} max_len={max_len} "
                             f"kv_heads={num_kv_heads} head_dim={head_dim}")
        shape = (num_layers, batch, max_len, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.batch, self.max_len = batch, max_len

    @classmethod
    def for_model(cls, config, batch: int, max_len: int, *, dtype: torch.dtype,
                  device: torch.device | str | None = None) -> ContiguousKVCache:
        """A cache shaped for a ModelConfig."""
        return cls(config.num_hidden_layers, batch, max_len, config.num_key_value_heads,
                   config.head_dim, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token adds: 2 * layers * kv_heads * head_dim * itemsize."""
        return self.nbytes // (self.batch * self.max_len)

    def context(self, query_lens: Sequence[int], context_lens: Sequence[int],
                rows: Sequence[int] | None = None) -> AttentionContext:
        """An AttentionContext whose sequence b lives in cache row rows[b] (default: row b)."""
        rows = list(range(len(query_lens))) if rows is None else list(rows)
        if len(rows) != len(query_lens):
            raise ValueError(f"{len(rows)} cache rows for {len(query_lens)} sequences")
        for r, q, c in zip(rows, query_lens, context_lens, strict=True):
            if not 0 <= r < self.batch:
                raise ValueError(f"cache row {r} out of range: the cache has {self.batch} rows")
            if q + c > self.max_len:
                raise ValueError(f"sequence of {q + c} tokens does not fit the cache's "
                                 f"{self.max_len} slots per row")
        slots = [
            r * self.max_len + c + i
            for r, q, c in zip(rows, query_lens, context_lens, strict=True)
            for i in range(q)
        ]
        identity = rows == list(range(len(rows)))
        tables = None if identity else torch.tensor(rows, device=self.k.device)[:, None]
        return AttentionContext.build(
            query_lens, context_lens, slots, block_tables=tables, device=self.k.device
        )

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext) -> None:
        # index_copy_ on the flat (slots, heads, dim) view: one scatter, no host sync.
        self.k[layer].view(-1, *k.shape[1:]).index_copy_(0, ctx.slot_mapping, k)
        self.v[layer].view(-1, *v.shape[1:]).index_copy_(0, ctx.slot_mapping, v)

    def read(self, layer: int, ctx: AttentionContext) -> tuple[torch.Tensor, torch.Tensor]:
        n = ctx.max_seq_len
        if ctx.block_tables is None:  # rows 0..B-1: a view, nothing copied
            k, v = self.k[layer, : ctx.num_seqs, :n], self.v[layer, : ctx.num_seqs, :n]
        else:
            rows = ctx.block_tables[:, 0]
            k, v = self.k[layer, rows, :n], self.v[layer, rows, :n]
        return k.transpose(1, 2), v.transpose(1, 2)  # (B, kv_heads, n, head_dim), strided

    def decode_attention(self, layer: int, q: torch.Tensor, ctx: AttentionContext, scale: float,
                         window: int | None) -> torch.Tensor:
        """Decode steps: q (B, Hq, D) against each row's cached keys in a few kernels (see
        decode_attention.py), instead of the general padded path."""
        keys, values = self.read(layer, ctx)
        memo = ctx.__dict__.setdefault("_step_memo", {})  # one mask per step, shared by the layers
        return padded_decode_attention(q, keys, values, ctx.seq_lens, scale, window, memo)
