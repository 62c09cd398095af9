"""Decode steps of a paged cache replayed from CUDA graphs, one graph per bucketed batch size.

Why: a decode step of a small model is hundreds of short kernels, and launching each from
Python costs more CPU time than the GPU spends running it (see layer 3's cuda_graph.py). A
CUDA graph records the step once; a replay launches all of it at once.

What must be static, and how it is made so (vLLM's and nano-vllm's recipe):
- *Addresses.* A graph replays the pointers it recorded. So every input lives in a static
  buffer (input_ids, positions, slot_mapping, seq_lens, block_tables) sized for
  max_num_seqs rows, and run() copies the step's values into them (run_host: positions,
  lengths, and ids that are on the host, in one copy, the tables in another, graph_inputs.py);
  the logits come out in a static buffer too.
- *Shapes.* The batch size is baked into every kernel, so graphs are captured for buckets
  (1, 2, 4, 8, 16, 24, ... max_num_seqs) and a batch of B runs the smallest bucket >= B,
  its extra rows padding. The block table width is fixed (max_blocks_per_seq): the paged
  kernel bounds the context by max_blocks_per_seq * block_size and reads each sequence's
  true length from seq_lens on the device, so one graph serves every context length.
- *Host values.* The AttentionContext's host ints are fixed at capture: max_query_len = 1,
  max_seq_len = max_blocks_per_seq * block_size. No step may copy to the host.
- *Memory.* All graphs share one memory pool (captured largest first): only one replays at a
  time, so their temporaries can overlap.

Padding rows must never touch a real sequence's cache. Each one is a one-token sequence at
position 0 whose block table points at the cache's scratch block (`cache.scratch_block`, an
extra block the block manager never hands out): it writes its k, v there and attends to
that one slot. run() resets them every step, since an earlier, larger batch left real
sequences' values in those rows.

The slot of each new token (block_tables[b, pos // bs] * bs + pos % bs) is computed on the
device inside the graph, so run() copies only what the scheduler has.

*Greedy tokens inside the graph.* Each replay ends with the argmax of its logits rows (layer
1's split argmax on a GPU), written over the step's own input ids: `input_ids[:B]` then holds
the step's greedy tokens, which are also the next step's input ids when the same sequences
decode again in the same order, so such a step copies no ids at all (run_host skips a copy
of input_ids onto itself). An all-greedy step samples nothing after the replay (the engine
takes `tokens(B)`); the logits stay in their buffer for everything else (logprobs,
temperature, grammar masks, which must sample after masking). Padding rows' ids are then
whatever their argmax was: any valid token id serves a row whose outputs nobody reads.
"""
from __future__ import annotations

import numpy as np
import torch

import layer3_model as l3

from .graph_inputs import GraphInputs


def greedy_into(logits: torch.Tensor, out: torch.Tensor) -> None:
    """out (B,) int64 = logits (B, V).argmax(-1), as the engine's greedy sampling picks it
    (layer 1's split argmax for CUDA rows, torch's elsewhere)."""
    if logits.is_cuda and logits.shape[1] > 0 and logits.stride(-1) == 1:
        l3.argmax(logits, out=out)
    else:
        torch.argmax(logits, dim=-1, out=out)


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, then every multiple of 8 up to max_num_seqs, and
    max_num_seqs itself (vLLM's default buckets)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sizes + [max_num_seqs]


class CudaGraphRunner:
    """Decode steps (one new token per sequence) of `model` over a paged `cache`, replayed from
    CUDA graphs captured for bucketed batch sizes up to max_num_seqs, with block tables up to
    max_blocks_per_seq wide. run(...) -> fp32 logits (B, V).

    The cache needs `k` (layers, blocks, block_size, kv_heads, head_dim), `block_size`,
    `scratch_block` and `decode_attention` (layer 4's PagedKVCache). capture=False runs the
    same buffers eagerly (no graphs; also on a CPU): for debugging and tests; so is copies
    (GraphInputs': on a CPU, fill the buffers through host arrays and copies as on a GPU)."""

    def __init__(self, model: l3.LlamaModel, cache, max_num_seqs: int, max_blocks_per_seq: int, *,
                 capture: bool = True, warmup: int = 1, copies: bool | None = None) -> None:
        if capture and not torch.cuda.is_available():
            raise RuntimeError("CUDA graphs need a CUDA GPU: torch.cuda.is_available() is False "
                               "here; "
                               "decode eagerly instead (cuda_graph=False)")
        if capture and (model.device.type != "cuda" or cache.k.device.type != "cuda"):
            raise RuntimeError("CUDA graphs need the model and the cache on a CUDA device; model "
                               "on "
                               f"{model.device}, cache on {cache.k.device}")
        if max_blocks_per_seq < 1:
            raise ValueError(f"max_blocks_per_seq must be >= 1, got {max_blocks_per_seq}")
        for name in ("block_size", "scratch_block", "decode_attention"):
            if not hasattr(cache, name):
                raise TypeError(f"the cache has no `{name}`: CudaGraphRunner needs a paged cache "
                                "(layer 4's PagedKVCache)")
        self.model, self.cache, self.captured = model, cache, capture
        self.buckets = bucket_sizes(max_num_seqs)
        # bucket_of[B]: the smallest bucket >= B, looked up once per step
        self.bucket_of = [next(b for b in self.buckets if b >= B) for B in range(max_num_seqs + 1)]
        self.max_num_seqs, self.max_blocks = max_num_seqs, max_blocks_per_seq
        self.block_size, self.scratch = cache.block_size, cache.scratch_block
        n, dev = max_num_seqs, model.device

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=dev)

        self.slot_mapping = zeros(n)
        # positions, seq_lens, input_ids, block_tables: the buffers the host fills in a copy
        self.inputs = GraphInputs(n, max_blocks_per_seq, self.scratch, dev, copies=copies)
        self.positions, self.seq_lens = self.inputs.positions, self.inputs.seq_lens
        self.input_ids, self.block_tables = self.inputs.input_ids, self.inputs.block_tables
        self._pad_rows(0)  # every row a padding row until a step fills it
        self.logits = torch.zeros((n, model.config.vocab_size), dtype=torch.float32, device=dev)
        self.contexts = {B: self._context(B) for B in self.buckets}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if capture:
            self._capture(warmup)

    def _context(self, B: int) -> l3.AttentionContext:
        """The step's AttentionContext for a bucket of B rows: views of the static buffers."""
        max_seq_len = self.max_blocks * self.block_size
        arange = torch.arange(B + 1, dtype=torch.int64, device=self.input_ids.device)
        return l3.AttentionContext(
            positions=self.positions[:B], slot_mapping=self.slot_mapping[:B], seq_ids=arange[:B],
            query_offsets=torch.zeros_like(arange[:B]), query_start_loc=arange,
            query_lens=torch.ones_like(arange[:B]),
            seq_lens=self.seq_lens[:B], max_query_len=1, max_seq_len=max_seq_len,
            query_lens_host=(1,) * B, seq_lens_host=(max_seq_len,) * B,
            block_tables=self.block_tables[:B])

    def _step(self, B: int) -> None:
        """The work a graph records: new tokens' slots from the block tables, then the model."""
        pos, bs = self.positions[:B], self.block_size
        block = self.block_tables[:B].gather(1, (pos // bs)[:, None])[:, 0]
        self.slot_mapping[:B].copy_(block * bs + pos % bs)
        logits = self.logits[:B]
        if isinstance(self.model, l3.LlamaModel):  # the head's output into the buffer itself
            self.model(self.input_ids[:B], self.contexts[B], self.cache, last_only=True,
                       logits_out=logits)
        else:  # (a network with LlamaModel's forward but no logits_out: layer 5's wrappers)
            logits[:] = self.model(self.input_ids[:B], self.contexts[B], self.cache,
                                   last_only=True)
        greedy_into(logits, self.input_ids[:B])  # the greedy tokens (see above)

    def _capture(self, warmup: int) -> None:
        def every_bucket() -> None:  # every bucket warmed up before any capture
            for B in self.buckets:
                for _ in range(warmup):
                    self._step(B)
        l3.warm_up(every_bucket, 1)
        pool = None
        for B in reversed(self.buckets):  # largest first: the pool it leaves fits the smaller ones
            graph, _ = l3.capture_graph(lambda B=B: self._step(B), warmup=0, pool=pool)
            pool = graph.pool()
            self.graphs[B] = graph
        torch.cuda.synchronize()

    def _pad_rows(self, start: int, stop: int | None = None) -> None:
        """Rows [start, stop) become padding: one token at position 0 in the scratch block."""
        self.input_ids[start:stop] = 0
        self.positions[start:stop] = 0
        self.seq_lens[start:stop] = 1
        self.block_tables[start:stop] = self.scratch
        self.inputs.forget()

    def can_run(self, batch: int, num_blocks: int) -> bool:
        """True if a decode step of `batch` sequences with block tables `num_blocks` wide fits."""
        return 1 <= batch <= self.max_num_seqs and 1 <= num_blocks <= self.max_blocks

    @torch.no_grad()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
            seq_lens: torch.Tensor, *, copy: bool = True) -> torch.Tensor:
        """One decode step: input_ids, positions, seq_lens (B,) (seq_lens[b] = positions[b] + 1),
        block_tables (B, n) with n <= max_blocks_per_seq, already holding the new token's block.
        Writes each new token's k, v into its slot; returns a copy of the fp32 logits (B, V),
        or with copy=False a view of the output buffer, which the next run overwrites (the
        engine samples it first, in stream order: no (B, V) copy per step)."""
        B = input_ids.shape[0]
        if input_ids.dim() != 1 or positions.shape != (B,) or seq_lens.shape != (B,) \
                or block_tables.dim() != 2 or block_tables.shape[0] != B:
            raise ValueError("expected input_ids, positions, seq_lens (B,) and block_tables (B, "
                             "n); got "
                             f"{tuple(input_ids.shape)}, {tuple(positions.shape)}, "
                             f"{tuple(seq_lens.shape)}, "
                             f"{tuple(block_tables.shape)}")
        if not self.can_run(B, block_tables.shape[1]):
            raise ValueError(f"a step of {B} sequences with {block_tables.shape[1]}-block tables "
                             "does not "
                             f"fit the captured graphs (<= {self.max_num_seqs} sequences, <= "
                             f"{self.max_blocks} "
                             f"blocks); run it eagerly")
        self.input_ids[:B].copy_(input_ids)
        self.load_and_replay(B, positions, seq_lens, block_tables)
        return self.logits[:B].clone() if copy else self.logits[:B]

    def load_and_replay(self, B: int, positions: torch.Tensor, seq_lens: torch.Tensor,
                        block_tables: torch.Tensor) -> None:
        """B rows' context into the static buffers (their input already there), the rest of
        the bucket padding, then the bucket's graph (uncaptured: its step, eagerly)."""
        bucket = self.bucket_of[B]
        n = block_tables.shape[1]
        self.positions[:B].copy_(positions)
        self.seq_lens[:B].copy_(seq_lens)
        self.block_tables[:B, :n].copy_(block_tables)
        self.inputs.forget()  # (run_host's next load copies its tables again)
        # columns past n keep stale ids: never read (every position < seq_lens <= n * block_size)
        if B < bucket:
            self._pad_rows(B, bucket)
        self._replay(bucket)

    def run_host(self, input_ids: torch.Tensor | np.ndarray, positions: np.ndarray,
                 block_tables: np.ndarray, gather: np.ndarray | None = None) -> torch.Tensor:
        """`run(..., copy=False)` from host arrays: positions (B,) and block_tables (B, n)
        int64 numpy, seq_lens = positions + 1; input_ids (B,) on the device, or int64 numpy
        on the host; gather (B,) int64 numpy: the ids are input_ids[gather] instead (the last
        step's tokens on the device, in another order). The context, host ids and the gather
        index reach the static buffers in one copy (graph_inputs.py) instead of one copy to
        the device and three (up to seven with padding rows) into the buffers. (No autograd
        to turn off around copies and a replay: only an eager step enters no_grad.)"""
        B = positions.shape[0]
        ids_rows = (input_ids if gather is None else gather).shape[0]
        if ids_rows != B or block_tables.ndim != 2 or block_tables.shape[0] != B \
                or not self.can_run(B, block_tables.shape[1]):
            raise ValueError(f"a step of {ids_rows} sequences with positions {positions.shape} "
                             f"and block tables {block_tables.shape} does not fit the captured "
                             f"graphs (<= {self.max_num_seqs} sequences, <= {self.max_blocks} "
                             "blocks); run it eagerly")
        self._replay(self.load_host(input_ids, positions, block_tables, gather))
        return self.logits[:B]

    def load_host(self, input_ids: torch.Tensor | np.ndarray, positions: np.ndarray,
                  block_tables: np.ndarray, gather: np.ndarray | None = None) -> int:
        """run_host's inputs into the static buffers (checked by the caller); returns the
        bucket to replay."""
        B = positions.shape[0]
        bucket = self.bucket_of[B]
        # padding rows keep whatever ids they hold: valid token ids, outputs never read
        if gather is not None:  # the index with the context, then the gather on the device
            self.inputs.load(B, bucket, positions, block_tables, gather=gather)
            self.input_ids[:B].copy_(input_ids[self.inputs.gather[:B]])
        elif isinstance(input_ids, np.ndarray):
            self.inputs.load(B, bucket, positions, block_tables, ids=input_ids)
        else:
            if input_ids.data_ptr() != self.input_ids.data_ptr():  # (else last step's tokens)
                self.input_ids[:B].copy_(input_ids)
            self.inputs.load(B, bucket, positions, block_tables)
        return bucket

    def tokens(self, B: int) -> torch.Tensor:
        """(B,) int64 on the device: the last replay's greedy tokens (its logits' argmax, which
        the step wrote over its input ids), valid until the next run."""
        return self.input_ids[:B]

    def _replay(self, bucket: int) -> None:
        """The bucket's graph (uncaptured: its step, eagerly), its inputs in place."""
        if self.captured:
            self.graphs[bucket].replay()
        else:
            with torch.no_grad():
                self._step(bucket)
