"""A pipeline stage's decode micro-batches replayed from CUDA graphs (cuda_graph=True, PP only).

Without graphs a stage launches every kernel of its layers from Python for every micro-batch
of every step: at a 1B model's decode that launch time, not the GPU, sets the pace. Here each
rank captures its stage's forward once per bucketed micro-batch size, over static buffers,
as layer 4's `CudaGraphRunner` does for a whole model (same buckets, padding rows in the
cache's scratch block, slots computed inside the graph). What differs:

- the input is stage 0's token ids, or, on a later stage, the residual stream (2, B, H) the
  stage before sent; the output is the stream for the next stage, or the last stage's
  logits (B, V) in the weights' dtype;
- the hand-offs stay outside the graphs (a NCCL receive into the static input would need
  every micro-batch's size fixed in advance): a micro-batch is received, copied into the
  static input, replayed, and its output copied out before it is sent (the next replay
  overwrites the static output while the send may still read it);
- no rank waits for another to capture: the graphs hold no collective.

Prefill and mixed steps run the stage eagerly, as before. On a CPU the same buffers run
without capturing (capture=False), so the CPU suite tests this path too.
"""
from __future__ import annotations

import numpy as np
import torch

import layer4_algorithms as engine


class StageGraphRunner(engine.CudaGraphRunner):
    """Decode micro-batches of `stage` (a StageNet) over its `cache`, up to `max_rows` rows
    with block tables up to `max_blocks` wide. run(inp, ctx) -> the stage's output rows."""

    def __init__(self, stage, cache, max_rows: int, max_blocks: int, *,
                 capture: bool = True) -> None:
        H, dev, dt = stage.full_config.hidden_size, stage.device, stage.dtype
        self.stream_in = None if stage.first else torch.zeros((2, max_rows, H), dtype=dt,
                                                               device=dev)
        self.out = torch.zeros((max_rows, stage.full_config.vocab_size) if stage.last else
                               (2, max_rows, H), dtype=dt, device=dev)
        self.replays = 0  # micro-batches run through the static buffers
        super().__init__(stage, cache, max_rows, max_blocks, capture=capture)
        self.logits = None  # layer 4's fp32 output buffer: this runner writes self.out

    def _step(self, B: int) -> None:
        pos, bs = self.positions[:B], self.block_size
        block = self.block_tables[:B].gather(1, (pos // bs)[:, None])[:, 0]
        self.slot_mapping[:B].copy_(block * bs + pos % bs)
        inp = self.input_ids[:B] if self.stream_in is None else self.stream_in[:, :B]
        y = self.model(inp, self.contexts[B], self.cache, last_only=True)
        if self.model.last:
            self.out[:B] = y
        else:
            self.out[:, :B] = y

    def applies(self, ctx, cache) -> bool:
        """Whether a micro-batch runs here: decode (one new token a sequence, a cache) that
        fits the captured buckets and table width."""
        return (cache is not None and ctx.max_query_len == 1 and ctx.block_tables is not None
                and self.can_run(ctx.num_seqs, ctx.block_tables.shape[1]))

    def run_micro_host(self, inp: torch.Tensor | np.ndarray, positions, block_tables,
                       copy: bool = True, gather: np.ndarray | None = None) -> torch.Tensor:
        """run_micro from host arrays, as layer 4's run_host: positions (B,) and block_tables
        (B, n) int64 numpy reach the static buffers in one copy each (graph_inputs.py), with no
        AttentionContext built (rank 0's decode steps: pipeline_parallel/runner.py); stage 0's
        token ids as run_host takes them (on the device, on the host, or gathered)."""
        B = positions.shape[0]
        if self.stream_in is None:
            bucket = self.load_host(inp, positions, block_tables, gather)
        else:
            bucket = self.bucket_of[B]
            self.stream_in[:, :B].copy_(inp)
            # padding rows keep whatever inputs they hold: a finite stream, whose outputs
            # nobody reads
            self.inputs.load(B, bucket, positions, block_tables)
        self._replay(bucket)
        self.replays += 1
        out = self.out[:B] if self.model.last else self.out[:, :B]
        return out.clone() if copy else out

    @torch.no_grad()
    def run_micro(self, inp: torch.Tensor, ctx, copy: bool = True) -> torch.Tensor:
        """One decode micro-batch: its input (ids (B,) or stream (2, B, H)) and context into
        the static buffers, the bucket's graph, a copy of the output rows (copy=False: a view
        of the output buffer, which the next replay overwrites: read it first, in stream
        order)."""
        B = ctx.num_seqs
        if self.stream_in is None:
            self.input_ids[:B].copy_(inp)
        else:
            self.stream_in[:, :B].copy_(inp)
        self.load_and_replay(B, ctx.positions, ctx.seq_lens, ctx.block_tables)
        self.replays += 1
        out = self.out[:B] if self.model.last else self.out[:, :B]
        return out.clone() if copy else out
