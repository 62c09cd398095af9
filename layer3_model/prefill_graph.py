"""CUDA graphs for batch-1 prefill, one per prompt-length bucket.

An eager 2048-token prefill of a 1B model issues ~150 launches from Python; on a slow or busy
host their enqueue takes as long as the GPU work, so the measured time follows the host's
speed. Replaying the forward from a CUDA graph takes one launch. A graph fixes every shape,
so a prompt of n tokens runs in the smallest bucket >= n, padded at the end: causal
attention keeps the n real tokens blind to the padding, so their outputs are the same
arithmetic as an eager prefill of n tokens (the same kernels when n == bucket; at n < bucket
a GEMM of another height may pick another cuBLAS kernel: last-bit differences). The padding
writes k, v into the row's slots n..bucket-1, which a later decode step overwrites before
any step reads them (attention reads positions < seq_len). vLLM captures its piecewise graphs
the same way, per padded token count.

Logits come out for the last real token only: the captured forward's `last_only` reads the
row from ctx.query_start_loc, a static buffer set to [0, n] before each replay.
"""
from __future__ import annotations

import dataclasses

import torch

from .attention_context import ContiguousKVCache
from .cuda_graph import capture_graph
from .model import LlamaModel

#: Prompt-length buckets (tokens); a prompt runs in the smallest that holds it.
BUCKETS = (128, 256, 512, 1024, 2048, 4096, 8192)


class CudaGraphPrefill:
    """prefill(input_ids (n,), row) -> fp32 logits (V,) of the prompt's last token, its k, v
    written to cache row `row` at positions 0..n-1, replayed from the graph of the smallest
    bucket >= n (captured on first use; buckets larger than the cache's rows are dropped)."""

    def __init__(self, model: LlamaModel, cache: ContiguousKVCache,
                 buckets: tuple[int, ...] = BUCKETS, *, warmup: int = 2) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA graphs need a CUDA GPU: torch.cuda.is_available() is "
                               "False here; prefill eagerly instead")
        if model.device.type != "cuda" or cache.k.device.type != "cuda":
            raise RuntimeError(f"CUDA graphs need the model and the cache on a CUDA device; "
                               f"model on {model.device}, cache on {cache.k.device}")
        limit = min(cache.max_len, model.config.max_position_embeddings)
        self.buckets = tuple(sorted(b for b in set(buckets) if 1 <= b <= limit))
        if not self.buckets:
            raise ValueError(f"no bucket in {buckets} fits the cache's {cache.max_len} slots "
                             f"per row and {model.config.max_position_embeddings} positions")
        self.model, self.cache, self.warmup = model, cache, warmup
        self._graphs: dict[int, _Bucket] = {}

    def bucket_for(self, n: int) -> int:
        for b in self.buckets:
            if n <= b:
                return b
        raise ValueError(f"a prompt of {n} tokens exceeds the largest bucket "
                         f"({self.buckets[-1]}); prefill it eagerly or in chunks")

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, row: int = 0) -> torch.Tensor:
        if input_ids.dim() != 1 or input_ids.numel() == 0:
            raise ValueError(f"input_ids must be a non-empty 1-D tensor of token ids, got "
                             f"shape {tuple(input_ids.shape)}")
        if not 0 <= row < self.cache.batch:
            raise ValueError(f"cache row {row} out of range: the cache has {self.cache.batch} "
                             "rows")
        n = input_ids.numel()
        b = self.bucket_for(n)
        g = self._graphs.get(b)
        if g is None:
            g = self._graphs[b] = _Bucket(self.model, self.cache, b, self.warmup)
        return g.replay(input_ids, n, row)


class _Bucket:
    """One bucket's static buffers (ids, slots, query_start_loc) and its captured forward."""

    def __init__(self, model: LlamaModel, cache: ContiguousKVCache, tokens: int,
                 warmup: int) -> None:
        dev = model.device
        ctx = cache.context([tokens], [0])
        # Static device buffers the graph reads; replay() rewrites them in place.
        self.ids = torch.zeros(tokens, dtype=torch.int64, device=dev)
        self.offsets = torch.arange(tokens, dtype=torch.int64, device=dev)
        self.ctx = dataclasses.replace(ctx, slot_mapping=ctx.slot_mapping.clone(),
                                       query_start_loc=ctx.query_start_loc.clone())
        self.max_len = cache.max_len

        def forward() -> torch.Tensor:
            return model(self.ids, self.ctx, cache, last_only=True)
        self.graph, self.logits = capture_graph(forward, warmup)

    def replay(self, input_ids: torch.Tensor, n: int, row: int) -> torch.Tensor:
        self.ids[n:].zero_()
        self.ids[:n].copy_(input_ids, non_blocking=True)
        torch.add(self.offsets, row * self.max_len, out=self.ctx.slot_mapping)
        self.ctx.query_start_loc[1].fill_(n)  # last_only reads row n - 1
        self.graph.replay()
        return self.logits[0].clone()
