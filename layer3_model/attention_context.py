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

import numpy as np
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
        slot_mapping: Sequence[int] | np.ndarray | torch.Tensor,
        *,
        block_tables: torch.Tensor | np.ndarray | None = None,
        device: torch.device | str | None = None,
        staging: HostStaging | None = None,
    ) -> AttentionContext:
        """Context for B sequences, sequence b bringing query_lens[b] new tokens after
        context_lens[b] tokens already in the cache. slot_mapping (T,) comes from the cache
        (host ints / a numpy array, or a tensor); block_tables a tensor, or a host (B, n)
        array sent along with the rest. Every host index array goes to the device in one
        copy from pinned memory that does not wait for the GPU (`staging`: reusable pinned
        buffers, see HostStaging; else a fresh pinned tensor), so a step's inputs can be
        prepared while the previous step still runs."""
        q = np.asarray(query_lens, dtype=np.int64).reshape(-1)
        c = np.asarray(context_lens, dtype=np.int64).reshape(-1)
        if q.shape != c.shape or not q.size:
            raise ValueError(f"need one query length and one context length per sequence, got "
                             f"{len(query_lens)} and {len(context_lens)}")
        if q.min() < 1 or c.min() < 0:
            raise ValueError("query lengths must be >= 1 and context lengths >= 0: "
                             f"{list(query_lens)}, {list(context_lens)}")
        B = q.size
        starts = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(q, out=starts[1:])
        T = int(starts[-1])
        if T == B:  # a decode step: one token per sequence, nothing to repeat
            seq_ids, offsets, positions = np.arange(B, dtype=np.int64), np.zeros(B, np.int64), c
        else:
            seq_ids = np.repeat(np.arange(B, dtype=np.int64), q)
            offsets = np.arange(T, dtype=np.int64) - np.repeat(starts[:-1], q)
            positions = np.repeat(c, q) + offsets
        seq_lens = q + c
        is_tensor = isinstance(slot_mapping, torch.Tensor)
        shape = tuple(slot_mapping.shape) if is_tensor else (len(slot_mapping),)
        if shape != (T,):
            raise ValueError(f"slot_mapping must hold one slot per new token ({T}), got {shape}")
        host_tables = block_tables is not None and not isinstance(block_tables, torch.Tensor)
        # Every index array in one host buffer and one copy to the device (a decode step pays
        # this every step; seven small copies cost seven transfers), then views of it.
        parts = [positions, seq_ids, offsets, starts, q, seq_lens]
        if not is_tensor:
            parts.append(np.asarray(slot_mapping, dtype=np.int64).reshape(-1))
        if host_tables:
            tables_np = np.asarray(block_tables, dtype=np.int64)
            parts.append(tables_np.reshape(-1))
        flat = np.concatenate(parts)
        on_device = to_device(flat, device, staging)
        views = on_device.split_with_sizes([p.size for p in parts])  # (half of split's cost)
        positions_t, seq_ids_t, offsets_t, starts_t, qlens_t, seq_lens_t = views[:6]
        if is_tensor:
            slots = slot_mapping.to(device=device, dtype=torch.int64)
        else:
            slots = views[6]
        if host_tables:
            block_tables = views[-1].view(tables_np.shape)
        q_host, s_host = q.tolist(), seq_lens.tolist()
        return cls(
            positions=positions_t,
            slot_mapping=slots,
            seq_ids=seq_ids_t,
            query_offsets=offsets_t,
            query_start_loc=starts_t,
            query_lens=qlens_t,
            seq_lens=seq_lens_t,
            max_query_len=max(q_host),
            max_seq_len=max(s_host),
            query_lens_host=tuple(q_host),
            seq_lens_host=tuple(s_host),
            block_tables=block_tables,
        )


def to_device(host: np.ndarray, device: torch.device | str | None,
              staging: HostStaging | None = None) -> torch.Tensor:
    """A host array on `device`. To a GPU from pinned memory, non-blocking: a copy from
    pageable memory waits for the GPU to finish its queued work first (a host sync). Without
    `staging` the pinned tensor is fresh: PyTorch's pinned-memory cache does not hand it out
    again before its copy has run."""
    device = torch.device("cpu" if device is None else device)
    if device.type != "cuda":
        return torch.from_numpy(host).to(device)
    if staging is not None:
        return staging.to_device(host)
    return torch.from_numpy(host).pin_memory().to(device, non_blocking=True)


class HostStaging:
    """Reusable pinned buffers for a step's host-to-device copies of int64 arrays (CUDA).

    Arenas are used in turn, one per step (`next_step()`), each filled front to back by that
    step's copies. A copy from pinned memory is queued on the stream behind the GPU's work
    and reads the buffer only when it runs, so a buffer must not be rewritten before then:
    the arena of step N is reused at step N + arenas, after waiting on the event recorded
    behind its last copy (with two arenas and the engine's one step in flight, that copy
    has long run: the wait costs nothing). Off CUDA it copies plainly."""

    def __init__(self, device: torch.device | str, arenas: int = 2, capacity: int = 4096) -> None:
        if arenas < 2:
            raise ValueError(f"HostStaging needs >= 2 arenas (double buffering), got {arenas}")
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self._bufs: list[torch.Tensor | None] = [None] * arenas
        self._np: list[np.ndarray | None] = [None] * arenas
        # one event per arena, made once and recorded again behind each step's last copy
        # (a fresh Event a step is a CUDA event created and destroyed a step); _recorded[a]:
        # arena a has copies that next_step must see run before it reuses the arena
        self._events: list[torch.cuda.Event | None] = [None] * arenas
        self._recorded = [False] * arenas
        self._retired: list[list[torch.Tensor]] = [[] for _ in range(arenas)]
        self._capacity, self._arena, self._used = capacity, 0, 0

    def next_step(self) -> None:
        """Switch to the next arena; wait (if ever needed) until its earlier copies ran."""
        self._arena = (self._arena + 1) % len(self._bufs)
        self._used = 0
        if self._recorded[self._arena]:
            self._events[self._arena].synchronize()
            self._recorded[self._arena] = False
        self._retired[self._arena].clear()

    def to_device(self, host: np.ndarray) -> torch.Tensor:
        """host (any shape, int64) -> a new device tensor of the same shape."""
        if not self.pinned:
            return torch.from_numpy(np.ascontiguousarray(host, dtype=np.int64)).to(self.device)
        n, a = host.size, self._arena
        buf = self._bufs[a]
        if buf is None or self._used + n > buf.numel():  # grow: keep the old one until reuse
            if buf is not None:
                self._retired[a].append(buf)
            size = max(self._capacity, 2 * n, 0 if buf is None else 2 * buf.numel())
            buf = self._bufs[a] = torch.empty(size, dtype=torch.int64, pin_memory=True)
            self._np[a] = buf.numpy()
            self._used = 0
        lo, hi = self._used, self._used + n
        self._np[a][lo:hi] = host.reshape(-1)
        self._used = hi
        out = buf[lo:hi].to(self.device, non_blocking=True)
        ev = self._events[a]
        if ev is None:
            ev = self._events[a] = torch.cuda.Event()
        ev.record()
        self._recorded[a] = True
        return out.view(host.shape)


class KVCache(Protocol):
    """What attention needs from a KV cache. Layer 4's paged cache implements the same two calls.

    Optional third method (not part of the protocol, looked up with getattr; ContiguousKVCache
    and layer 4's paged cache have it; a cache without it gets the general padded path):

        decode_attention(layer, q (B, Hq, D), ctx, scale, window) -> (B, Hq, D)

    called instead of `read` + attention on steps with ctx.max_query_len == 1 (q's row b is
    sequence b's one new token, whose k, v `write` has already stored). It must give what
    `read` + masked attention would (keys at positions < seq_lens[b], and > position - window
    with a sliding window) and must not copy to the host (the decode step is graph-captured).

    Further optional views for the triton backend's fused kernels (layer 4's paged cache has
    both; a cache without them gets `write` and `read`):

        slot_views(layer)  -> k, v (slots, kv_heads, head_dim): the rows ctx.slot_mapping names
        block_views(layer) -> k, v (blocks, block_size, kv_heads, head_dim): the blocks
                              ctx.block_tables names (prefill attention reads keys in place)
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
