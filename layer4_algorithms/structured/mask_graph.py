"""The apply's launches replayed from a CUDA graph (opt-in: LLM_STACK_MASK_GRAPH=1).

On a GPU, TokenMasks.launch issues two things a step: the copy of the arena (bitmask rows +
row indices) to the device and the Triton kernel that writes -inf. Their device time is a
few microseconds, but their host time (a copy_ call, the kernel's launch through Triton's
Python launcher) was ~50 us back to back and ~100 us a step inside the engine on an H100 host:
on a host-bound step (a small model under CUDA graphs) that is the largest part of the mask's
cost once the fill is off the engine's thread. Both are replayable: the copy reads pinned host
memory that the arena reuses step after step, and the kernel writes a logits buffer that CUDA
graph decoding reuses too. So a launch whose buffers (host arena, device buffer, logits
address and shape, row count) have been seen WARM times in a row is captured once into a CUDA
graph (copy + kernel) and replayed from then on: one graph launch instead of two launches.
Anything else (a new row count, eager logits at a new address) takes the plain launches.
At most MAX_GRAPHS graphs are kept (least recently used dropped); a capture that fails turns
the graphs off for this engine (`failed` says why) and the plain launches go on.
"""
from __future__ import annotations

import os
from collections import OrderedDict

import torch

WARM = 3
MAX_GRAPHS = 16


def mask_graph_enabled() -> bool:
    """LLM_STACK_MASK_GRAPH: 1 (true/yes/on) replays the apply from CUDA graphs; 0 (or unset,
    false/no/off) launches it plainly; ValueError for anything else."""
    env = os.environ.get("LLM_STACK_MASK_GRAPH", "").strip().lower()
    on = switch(env or "0")
    if on is None:
        raise ValueError(f"LLM_STACK_MASK_GRAPH={env!r}: need 1 or 0")
    return on


def switch(word: str) -> bool | None:
    """An environment switch's word: True for 1/true/yes/on, False for 0/false/no/off
    (lower case), None for anything else (the caller names what it takes)."""
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    return None


def plain(logits: torch.Tensor, host: torch.Tensor, dev: torch.Tensor, R: int, n: int,
          W: int) -> None:
    """The copy of the arena's first n words (R * W bitmask words, then R row indices) and
    the kernel that masks logits' rows with them."""
    from .mask_kernel import apply_bitmask_triton

    dev[:n].copy_(host[:n], non_blocking=True)
    apply_bitmask_triton(logits, dev[:R * W].view(R, W), dev[R * W:n])


class MaskGraphs:
    """TokenMasks' apply launches, replayed from CUDA graphs once their buffers are steady.
    `stats`: graphs captured, launches replayed, plain launches."""

    def __init__(self) -> None:
        self._graphs: OrderedDict[tuple, torch.cuda.CUDAGraph] = OrderedDict()
        self._key: tuple | None = None  # the last plain launch's buffers, and how often
        self._runs = 0  # in a row
        self.failed: str | None = None
        self.stats = {"captures": 0, "replays": 0, "plain": 0}

    def run(self, logits: torch.Tensor, host: torch.Tensor, dev: torch.Tensor, R: int,
            n: int, W: int) -> None:
        key = (host.data_ptr(), dev.data_ptr(), R, n, W, logits.data_ptr(), logits.stride(0),
               tuple(logits.shape), logits.dtype)
        graph = self._graphs.get(key)
        if graph is None and self.failed is None:
            self._runs = self._runs + 1 if key == self._key else 1
            self._key = key
            if self._runs > WARM:  # (the kernel compiled, the buffers steady)
                graph = self._capture(logits, host, dev, R, n, W, key)
        if graph is None:
            plain(logits, host, dev, R, n, W)
            self.stats["plain"] += 1
            return
        self._graphs.move_to_end(key)
        graph.replay()
        self.stats["replays"] += 1

    def _capture(self, logits, host, dev, R, n, W, key) -> torch.cuda.CUDAGraph | None:
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                plain(logits, host, dev, R, n, W)
        except Exception as e:  # noqa: BLE001 - the plain launches go on, and say why
            self.failed = f"{type(e).__name__}: {e}"
            return None
        self.stats["captures"] += 1
        self._graphs[key] = graph
        while len(self._graphs) > MAX_GRAPHS:
            self._graphs.popitem(last=False)
        return graph
