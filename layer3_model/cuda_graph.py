"""CUDA-graph capture of the decode step.

A decode step of a small model is hundreds of tiny kernels; from Python each launch costs
microseconds of CPU time, often more than the kernel itself, so the GPU sits idle between
them. A CUDA graph records the whole step once and replays it with one launch. The price:
everything must be static. The graph holds the *addresses* of its inputs and outputs, so
new tokens are copied into the same buffers every step, the batch size is fixed, and
attention always spans the cache's full max_len (masked), never a shape that changes
with the sequence. No step may copy to the host (that would not be recorded).
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from layer2_comm import kernels

from .attention_context import ContiguousKVCache
from .model import LlamaModel


def warm_up(forward: Callable[[], Any], times: int = 2,
            mode: Callable[[], contextlib.AbstractContextManager] = torch.no_grad) -> None:
    """Run `forward` `times` times on a side stream, as a capture needs first: Triton compiles
    its kernels, cuBLAS picks its algorithms and the caching allocator holds the blocks, none
    of which may happen while a graph records. mode: the autograd mode to run under."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), mode():
        for _ in range(times):
            forward()
    torch.cuda.current_stream().wait_stream(side)


def capture_graph(forward: Callable[[], Any], warmup: int = 2, *, pool=None,
                  mode: Callable[[], contextlib.AbstractContextManager] = torch.no_grad,
                  ) -> tuple[torch.cuda.CUDAGraph, Any]:
    """`warm_up(forward, warmup)`, then record one call of `forward` into a CUDA graph (in
    memory pool `pool`, when graphs should share one). Returns (graph, what the recorded call
    returned): its tensors are the graph's outputs, rewritten in place by each replay."""
    warm_up(forward, warmup, mode)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool), mode():
        out = forward()
    return graph, out


def graph_replay_us(fns: Callable[[], Any] | Sequence[Callable[[], Any]], *, calls: int = 1,
                    replays: int = 10, warmup: int = 2) -> float:
    """Microseconds per call with the host out of the way: `calls` rounds of `fns` (one
    callable or several, each called once a round) recorded in one CUDA graph after `warmup`
    untimed rounds, the graph replayed once untimed, then `replays` times between two CUDA
    events. What is left is the kernels and their launch gaps on the GPU: the cost a step
    replayed from a graph pays, not the Python wrappers that do_bench also times."""
    fns = [fns] if callable(fns) else list(fns)

    def one_round() -> None:
        for fn in fns:
            fn()

    def rounds() -> None:
        for _ in range(calls):
            one_round()
    warm_up(one_round, warmup)
    graph, _ = capture_graph(rounds, warmup=0)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (calls * len(fns) * replays)


class CudaGraphDecoder:
    """Decode steps of `batch_size` sequences, one token each, in cache rows 0..B-1, replayed
    from a CUDA graph. step(input_ids (B,), positions (B,)) -> fp32 logits (B, V);
    with greedy=True also step_greedy(...) -> the argmax tokens (B,), taken inside the graph
    by layer 1's split argmax (torch's one-block argmax of a 128k-vocabulary row costs ~32 us
    on an H100, 3% of a 1B model's step) and no (B, V) logits copy."""

    def __init__(self, model: LlamaModel, cache: ContiguousKVCache, batch_size: int | None = None,
                 *, warmup: int = 2, greedy: bool = False) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA graphs need a CUDA GPU: "
                               "torch.cuda.is_available() is False here; "
                               "decode eagerly instead (Model(..., cuda_graph=False))")
        if model.device.type != "cuda" or cache.k.device.type != "cuda":
            raise RuntimeError(f"CUDA graphs need the model and the cache on a CUDA device; "
                               f"model on {model.device}, cache on {cache.k.device}")
        B = batch_size or cache.batch
        if not 1 <= B <= cache.batch:
            raise ValueError(f"batch_size {B} must be in [1, {cache.batch}] (the cache's rows)")
        self.model, self.cache, self.batch_size = model, cache, B
        # capture writes into the last slot: never read before it is rewritten
        last = cache.max_len - 1
        ctx = cache.context([1] * B, [last] * B)
        # Static shapes: attention spans every slot of a row, masked by the device-side seq_lens.
        # positions, slot_mapping and seq_lens: rows of one buffer, so the graph derives the
        # last two from the first in one kernel (a step copies only ids and positions in).
        io = torch.stack([ctx.positions, ctx.slot_mapping, ctx.seq_lens])
        self.ctx = dataclasses.replace(
            ctx, positions=io[0], slot_mapping=io[1], seq_lens=io[2],
            max_seq_len=cache.max_len, seq_lens_host=(cache.max_len,) * B
        )
        self._io = io
        self._offsets = torch.stack([torch.arange(B, device=io.device) * cache.max_len,
                                     torch.ones(B, dtype=io.dtype, device=io.device)])
        self.input_ids = torch.zeros(B, dtype=torch.int64, device=model.device)

        def forward() -> tuple[torch.Tensor, torch.Tensor | None]:
            torch.add(self._offsets, io[0], out=io[1:])  # slots = row * max_len + pos; pos + 1
            logits = model(self.input_ids, self.ctx, cache, last_only=True)
            return logits, (kernels.argmax(logits) if greedy else None)

        self.graph, (self.logits, self.next_ids) = capture_graph(forward, warmup)

    def _replay(self, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        if input_ids.shape != (self.batch_size,) or positions.shape != (self.batch_size,):
            raise ValueError(f"input_ids and positions must be ({self.batch_size},), got "
                             f"{tuple(input_ids.shape)} and {tuple(positions.shape)}")
        self.input_ids.copy_(input_ids)
        self.ctx.positions.copy_(positions)  # (slots and seq_lens: computed in the graph)
        self.graph.replay()

    @torch.no_grad()
    def step(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token b at position positions[b] of sequence b (cache row b): writes its k, v at
        that slot, attends to positions <= it, returns a copy of the logits (B, V)."""
        self._replay(input_ids, positions)
        return self.logits.clone()

    @torch.no_grad()
    def step_greedy(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """step, returning the logits' argmax (B,) int64 (a copy) instead of the logits: what
        `step(...).argmax(-1)` gives, without copying the (B, V) logits out of the graph."""
        if self.next_ids is None:
            raise ValueError("step_greedy needs a decoder built with greedy=True")
        self._replay(input_ids, positions)
        return self.next_ids.clone()
