"""The engine's prefill steps replayed from CUDA graphs, one per token-count bucket.

An eager prefill step issues ~9 launches a layer from Python. For a lone 2048-token prompt
of a 1B model that is ~9 ms of host time against ~7.5 ms of GPU work (H200): the step runs
at the host's speed. Replayed from a CUDA graph it is one launch and a few input copies.

A graph fixes every shape, so a step of n tokens runs in the graph of the smallest token
bucket >= n (128, 256, ... up to max_num_batched_tokens), and its tokens [n, bucket) are
padding. Two kinds of step are captured per bucket:

- "one": a single fresh prompt (context 0), the padding appended to it. Causal attention
  (layer 3's single-sequence flash kernel over all `bucket` rows) keeps the n real tokens
  blind to the padding behind them: their outputs are the same arithmetic as the eager step.
- "many": up to max_seqs sequences with any context (chunks, prefix hits, a few prompts at
  once), as the varlen flash kernel's rows 0..k-1 reading keys through the block tables;
  rows k..max_seqs-1 empty (no query, no key), and the padding a sequence of its own in the
  last row, so no real sequence ever sees it.

Padding never writes a real block: its tokens' slots are in the cache's scratch block (the
block no sequence owns, where the decode graphs' padding rows write too), their positions 0,
and the padding row's block table is all scratch. Many padding tokens writing one slot race,
harmlessly: nothing reads the scratch block's values for a real token.

The graph's host ints are fixed at capture: max_query_len = bucket (the kernels' grids cover
the longest a sequence can be; blocks past a sequence's end exit at once). The logits come
out of the captured forward's `last_only`, which reads each row's last token from
query_start_loc, a static buffer: rows 0..k-1 are the step's sequences' (the rest are read
by nobody). A padded step's GEMMs have another height than the eager step's, so cuBLAS may
pick another kernel: logits equal up to the last bits, not bit for bit.

Static inputs: one int64 buffer `ids | query_start_loc | seq_lens | tables | positions |
slots` that a step fills from the host in one copy. A "one" step copies only up to its
table's row (ids, n, the ~n / block_size block ids): its graph works out the positions (an
arange up to n, 0 past it) and slots (its table's block * block_size + offset, the scratch
block's past n) itself, a few small kernels, so the host does no per-token work. The
host writes the step's values straight into a pinned array of the same layout and copies it
without waiting (two such arrays, used in turn: one is rewritten only once its copy of two steps
ago has run, which an event recorded behind it tells). Input ids on the host (a prefill's) ride
in that copy; ids on the device (a decoding sequence's token from the last step, async
scheduling) are copied into place after it. Memory: the graphs share one
pool, captured largest bucket first, so the pool is about one largest-bucket forward's
temporaries (the activations of max_num_batched_tokens tokens: what an eager step of that
size takes too, held for good); plus the (max_seqs + 1, vocab) fp32 logits buffer.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

import layer3_model as l3

from .cuda_events import record

#: The smallest token bucket: shorter steps run in it (their host time is as long as a
#: bigger step's, their GPU time shorter: the graph helps them most).
MIN_BUCKET = 128
#: Sequences a "many" step may hold (more: eager); each costs a row of the attention grid.
MAX_PREFILL_SEQS = 4
KINDS = ("one", "many")


def token_buckets(max_tokens: int, smallest: int = MIN_BUCKET) -> list[int]:
    """Token counts to capture: powers of two from `smallest` below max_tokens, and
    max_tokens itself (the scheduler's token budget: no step is longer)."""
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
    sizes, b = [], smallest
    while b < max_tokens:
        sizes.append(b)
        b *= 2
    return sizes + [max_tokens]


class PrefillGraphRunner:
    """Steps of `model` over the paged `cache` whose sequences bring tokens_in <= max_tokens
    tokens in all, replayed from CUDA graphs (module docstring). plan(group) -> (bucket, kind)
    or None (the step does not fit: run it eagerly); run(plan, group, ids, table) -> fp32
    logits (k, V) of each sequence's last token, a view of the output buffer that the next
    replay overwrites.

    The cache needs `block_size`, `scratch_block` and slot / block views (layer 4's
    PagedKVCache); the model the triton backend's flash attention (l3.pads_prefill_attention
    False: the general path's padded shapes follow the step's lengths on the host).
    capture=False runs the same buffers eagerly (no graphs; also on a CPU): for tests."""

    def __init__(self, model: l3.LlamaModel, cache, max_tokens: int, max_blocks: int, *,
                 max_seqs: int = MAX_PREFILL_SEQS, capture: bool = True,
                 warmup: int = 1) -> None:
        if capture and not torch.cuda.is_available():
            raise RuntimeError("CUDA graphs need a CUDA GPU: torch.cuda.is_available() is False "
                               "here; prefill eagerly instead (prefill_cuda_graph=False)")
        if capture and (model.device.type != "cuda" or cache.k.device.type != "cuda"):
            raise RuntimeError("CUDA graphs need the model and the cache on a CUDA device; model "
                               f"on {model.device}, cache on {cache.k.device}")
        if l3.pads_prefill_attention(model):
            raise ValueError("prefill graphs need the triton backend's flash attention (no "
                             "sliding window, a head_dim its kernels have): the general "
                             "attention path pads to the step's lengths, which a graph cannot "
                             "follow; prefill eagerly instead (prefill_cuda_graph=False)")
        for name in ("block_size", "scratch_block", "block_views"):
            if not hasattr(cache, name):
                raise TypeError(f"the cache has no `{name}`: PrefillGraphRunner needs a paged "
                                "cache (layer 4's PagedKVCache)")
        if not isinstance(max_seqs, int) or max_seqs < 1:
            raise ValueError(f"max_seqs must be an int >= 1, got {max_seqs!r}")
        if not isinstance(max_blocks, int) or max_blocks < 1:
            raise ValueError(f"max_blocks must be an int >= 1, got {max_blocks!r}")
        self.model, self.cache, self.captured = model, cache, capture
        self.buckets = token_buckets(max_tokens)
        self.max_tokens, self.max_seqs = max_tokens, max_seqs
        bs = self.block_size = cache.block_size
        self.scratch = cache.scratch_block
        R = self.rows = max_seqs + 1  # the last row: the padding's own sequence
        # the padding row's table must span the padding (up to a whole bucket)
        W = self.width = max(max_blocks, -(-max_tokens // bs))
        T, dev = max_tokens, model.device
        # one buffer the host fills in one copy: ids | query_start_loc | seq_lens | tables
        # (rows x width) | positions | slots; a "one" step copies up to its table's row
        sizes = [T, R + 1, R, R * W, T, T]
        self.io = torch.zeros(sum(sizes), dtype=torch.int64, device=dev)
        parts = self.io.split(sizes)
        self.ids, self.query_start_loc, self.seq_lens = parts[:3]
        self.block_tables = parts[3].view(R, W)
        self.positions, self.slots = parts[4:]
        self._one_size = sum(sizes[:3]) + W
        # what a "one" step's graph makes its positions and slots from: token t's block index
        # and offset in its table (its position is t), and the padding's scratch slots
        tok = torch.arange(max(T, bs), dtype=torch.int64, device=dev)
        self._tok, self._tok_block, self._tok_offset = tok, tok // bs, tok % bs
        self._tok_pad = self.scratch * bs + tok % bs
        self.logits = torch.zeros((R, model.config.vocab_size), dtype=torch.float32, device=dev)
        self._one_logits = self.logits[:1]
        # the host's copies of io (pinned, two used in turn on a GPU), padding rows' values,
        # which no step changes, written once
        self._pinned = dev.type == "cuda"
        self._host_t = [torch.zeros(self.io.numel(), dtype=torch.int64, pin_memory=self._pinned)
                        for _ in range(2 if self._pinned else 1)]
        self._host_parts = []
        for h in self._host_t:
            hp = np.split(h.numpy(), np.cumsum(sizes[:5]))
            hp[3] = hp[3].reshape(R, W)
            hp[3][:] = self.scratch
            self._host_parts.append(hp)
        self._events: list[torch.cuda.Event | None] = [None] * len(self._host_t)
        self._dirty = [0] * len(self._host_t)  # table rows a "many" step wrote, per host copy
        self._turn = 0
        self._copies: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._arange = np.arange(max(T, bs), dtype=np.int64)
        self._slot_grid = np.zeros((W, bs), dtype=np.int64)  # a lone sequence's slots, by block
        self._pad_slots = self.scratch * bs + self._arange % bs
        self.contexts = {(b, kind): self._context(b, kind) for b in self.buckets
                         for kind in KINDS}
        self.graphs: dict[tuple[int, str], torch.cuda.CUDAGraph] = {}
        self.pool_bytes = 0
        if capture:
            self._capture(warmup)

    def _context(self, T: int, kind: str) -> l3.AttentionContext:
        """A bucket's AttentionContext: views of the static buffers, host ints for `bucket`
        tokens. "one": a single fresh sequence (is_prefill: the single-sequence kernel over
        this step's own k, v). "many": rows sequences whose keys are read through the block
        tables (seq_lens_host unequal to query_lens_host: not is_prefill, the paged path)."""
        R, W, dev = self.rows, self.width, self.io.device
        if kind == "one":
            zero = torch.zeros(1, dtype=torch.int64, device=dev)
            return l3.AttentionContext(
                positions=self.positions[:T], slot_mapping=self.slots[:T],
                seq_ids=zero.expand(T), query_offsets=torch.arange(T, device=dev),
                query_start_loc=self.query_start_loc[:2], query_lens=self.seq_lens[:1],
                seq_lens=self.seq_lens[:1], max_query_len=T, max_seq_len=T,
                query_lens_host=(T,), seq_lens_host=(T,), block_tables=None)
        return l3.AttentionContext(
            positions=self.positions[:T], slot_mapping=self.slots[:T],
            seq_ids=torch.zeros(T, dtype=torch.int64, device=dev),
            query_offsets=torch.zeros(T, dtype=torch.int64, device=dev),
            query_start_loc=self.query_start_loc, query_lens=self.seq_lens,
            seq_lens=self.seq_lens, max_query_len=T, max_seq_len=W * self.block_size,
            query_lens_host=(T,) * R, seq_lens_host=(T + 1,) * R, block_tables=self.block_tables)

    def _step(self, T: int, kind: str) -> None:
        """What a graph records: the forward over the bucket's tokens, the logits of each
        row's last token into the static buffer."""
        rows = 1 if kind == "one" else self.rows
        out = self.logits[:rows]
        ctx = self.contexts[(T, kind)]
        if kind == "one":  # positions and slots from n and the table's row (module docstring)
            real = self._tok[:T] < self.query_start_loc[1]
            torch.mul(self._tok[:T], real, out=self.positions[:T])
            own = torch.add(self._tok_offset[:T], self.block_tables[0][self._tok_block[:T]],
                            alpha=self.block_size)
            torch.where(real, own, self._tok_pad[:T], out=self.slots[:T])
        if isinstance(self.model, l3.LlamaModel):  # the head's output into the buffer itself
            self.model(self.ids[:T], ctx, self.cache, last_only=True, logits_out=out)
        else:  # (a network with LlamaModel's forward but no logits_out)
            out[:] = self.model(self.ids[:T], ctx, self.cache, last_only=True)

    def _capture(self, warmup: int) -> None:
        # warm-up and capture inputs: token 0 a one-token sequence in row 0 (scratch slots,
        # like all the rest: padding), the other rows empty
        hp = self._host_parts[0]
        self._fill_padding(hp, self.buckets[-1])
        hp[1][1:], hp[2][0] = 1, 1
        self.io.copy_(self._host_t[0].to(self.io.device))
        keys = [(b, kind) for b in reversed(self.buckets) for kind in KINDS]

        def every_graph() -> None:  # warmed up (compiles, cuBLAS plans) before any capture
            for key in keys:
                for _ in range(warmup):
                    self._step(*key)
        l3.warm_up(every_graph, 1)
        torch.cuda.synchronize(self.io.device)
        # each capture empties the allocator's cache first: do it now, so that the reserved
        # memory's growth is the graphs' pool
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(self.io.device)
        pool = None
        for key in keys:  # largest first: the pool it leaves fits the smaller ones
            graph, _ = l3.capture_graph(lambda key=key: self._step(*key), warmup=0, pool=pool)
            pool = graph.pool()
            self.graphs[key] = graph
        torch.cuda.synchronize(self.io.device)
        self.pool_bytes = torch.cuda.memory_reserved(self.io.device) - before

    def _fill_padding(self, hp: list, T: int, n: int = 0) -> None:
        """Tokens [n, T) of host layout hp: padding (position 0, a scratch slot)."""
        _, _, _, _, pos, slots = hp
        pos[n:T] = 0
        slots[n:T] = self._pad_slots[:T - n]

    def bucket_for(self, n: int) -> int | None:
        """The smallest bucket >= n tokens, None past the largest."""
        for b in self.buckets:
            if n <= b:
                return b
        return None

    def plan(self, group: Sequence) -> tuple[int, str] | None:
        """(bucket, kind) for a step of ScheduledSeqs `group`, or None when no graph fits it:
        drafts to verify (their rows' logits), more than max_seqs sequences, more tokens than
        the largest bucket."""
        if not group or len(group) > self.max_seqs or any(s.spec_token_ids for s in group):
            return None
        bucket = self.bucket_for(sum(s.num_new_tokens for s in group))
        if bucket is None:
            return None
        if len(group) == 1 and group[0].context_len == 0:
            return bucket, "one"
        return bucket, "many"

    def run(self, plan: tuple[int, str], group: Sequence, ids: torch.Tensor | np.ndarray,
            table: np.ndarray, lens: np.ndarray) -> torch.Tensor | None:
        """The step `group` (planned by plan()) from its graph: ids (n,) its input ids, int64 on
        the host (numpy: they go with the step's other inputs, one copy) or on the device,
        table (k, m) int64 its block tables (zero-padded), lens (k,) their lengths.
        Returns the (k, V) logits view, or None when a table is wider than the graphs' (run
        it eagerly)."""
        T, kind = plan
        k = len(group)
        if table.ndim != 2 or table.shape[0] != k or np.shape(lens) != (k,):
            raise ValueError(f"need one block table row and length per sequence ({k}), got "
                             f"{table.shape} and {np.shape(lens)}")
        if table.shape[1] > self.width:
            return None
        if k == 1:  # (a lone sequence: no arrays of one)
            s = group[0]
            q0, c0 = s.num_new_tokens, s.context_len
            n = q0
            if lens[0] * self.block_size < q0 + c0:  # (else its slots would land in block 0)
                raise ValueError(f"block table of {lens[0]} blocks cannot hold {q0 + c0} tokens")
        else:
            q = np.fromiter((s.num_new_tokens for s in group), dtype=np.int64, count=k)
            c = np.fromiter((s.context_len for s in group), dtype=np.int64, count=k)
            short = np.flatnonzero(np.asarray(lens) * self.block_size < q + c)
            if short.size:  # (else its slots would land in block 0, someone else's)
                b = int(short[0])
                raise ValueError(f"block table of {lens[b]} blocks cannot hold {q[b] + c[b]} "
                                 "tokens")
            n = int(q.sum())
        if tuple(ids.shape) != (n,):
            raise ValueError(f"input ids must be ({n},) for this step's tokens, got "
                             f"{tuple(ids.shape)}")
        turn = self._turn
        self._turn = (turn + 1) % len(self._host_t)
        if self._events[turn] is not None:  # its copy of two steps ago has run (long since)
            self._events[turn].synchronize()
        hp = self._host_parts[turn]
        host_ids, qsl, seq_lens, tables, pos, slots = hp
        if self._dirty[turn]:  # the table rows an earlier "many" step wrote: padding again
            tables[:self._dirty[turn]] = self.scratch
            self._dirty[turn] = 0
        bs = self.block_size
        if isinstance(ids, np.ndarray):  # tokens [n, T) keep earlier ids: valid, never read
            host_ids[:n] = ids
        qsl[0] = 0
        if kind == "one":  # ids, n and the table's blocks: the graph does the rest (_step)
            nb = -(-n // bs)
            qsl[1] = n
            # the bucket's one sequence (seq_lens_host): not read by the single-sequence
            # kernel, written so that nothing reads a "many" step's stale length
            seq_lens[0] = T
            tables[0, :nb] = table[0, :nb]
            self._dirty[turn] = 1
            self._launch(plan, turn, self._one_size, ids, n)
            return self._one_logits
        if k == 1:  # slots block by block: (blocks, block_size) ids, the run [c0, c0 + n)
            p = (self._arange[c0:c0 + n] if c0 + n <= self._arange.shape[0]
                 else np.arange(c0, c0 + n, dtype=np.int64))
            nb = -(-(c0 + n) // bs)
            pos[:n] = p
            np.add(table[0, :nb, None] * bs, self._arange[:bs], out=self._slot_grid[:nb])
            slots[:n] = self._slot_grid[:nb].reshape(-1)[c0:c0 + n]
        else:
            starts = np.cumsum(q) - q
            p = self._arange[:n] - np.repeat(starts, q) + np.repeat(c, q)
            blocks = table[np.repeat(np.arange(k), q), p // bs]
            pos[:n] = p
            np.add(blocks * bs, p % bs, out=slots[:n])
        self._fill_padding(hp, T, n)
        R = self.rows
        if k == 1:
            q, c, starts = np.array([n]), np.array([c0]), np.zeros(1, dtype=np.int64)
        qsl[1:k + 1] = starts + q
        qsl[k + 1:R] = n  # empty rows: no query, no key
        qsl[R] = T  # the padding's sequence
        seq_lens[:k] = c + q
        seq_lens[k:R - 1] = 0
        seq_lens[R - 1] = T - n
        tables[:k, :table.shape[1]] = table
        self._dirty[turn] = k
        self._launch(plan, turn, self.io.numel(), ids, n)
        return self.logits[:k]

    def _launch(self, plan: tuple[int, str], turn: int, size: int,
                ids: torch.Tensor | np.ndarray, n: int) -> None:
        """Host copy `turn`'s first `size` entries to the static buffer (without waiting on a
        GPU; an event tells when it has run), device ids into place, then the plan's graph
        (or, not captured, the same forward eagerly)."""
        pair = self._copies.get((turn, size))
        if pair is None:  # (the views made once: slicing a tensor is a few us of Python)
            pair = self._copies[(turn, size)] = (self.io[:size], self._host_t[turn][:size])
        pair[0].copy_(pair[1], non_blocking=self._pinned)
        if self._pinned:
            if self._events[turn] is None:
                self._events[turn] = torch.cuda.Event()
            record(self._events[turn])
        if not isinstance(ids, np.ndarray):
            self.ids[:n].copy_(ids)
        if self.captured:
            self.graphs[plan].replay()
        else:
            with torch.no_grad():
                self._step(*plan)
