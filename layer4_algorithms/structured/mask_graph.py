"""The apply's launches replayed from a CUDA graph (engines that decode with CUDA graphs).

On a GPU, TokenMasks.launch issues two things a step: the copy of the arena (bitmask rows +
row indices) to the device and the Triton kernel that writes -inf. Their device time is a
few microseconds, but their host time (a copy_ call, the kernel's launch through Triton's
Python launcher) was ~50 us back to back and ~100 us a step inside the engine on an H100 host:
on a host-bound step (a small model under CUDA graphs) that is as dear as a third of the
rows' fill. Unlike the fill, both are replayable: the copy reads pinned host
memory that the arena reuses step after step, and the kernel writes a logits buffer that CUDA
graph decoding reuses too. So a launch whose buffers (host arena, device buffer, logits
address and shape, row count) have been seen WARM times (the two arenas alternate, so each
has its own graph) is captured once into a CUDA graph (copy + kernel) and replayed from then
on: one graph launch instead of two launches. When every row samples greedily the graph
also writes the masked rows' argmax (`argmax`: over the decode graph's input ids, where its
own unmasked argmax went, so the next step's ids need no copy either), so the step's
sampling launches nothing (the unconstrained step's argmax sits in its decode graph; a
constrained step's cannot: its mask comes after that graph). Anything else (a new row
count, eager logits at a new address) takes the plain launches. At most MAX_GRAPHS graphs
are kept (least recently used dropped) and at most MAX_CAPTURES are ever made (a server
whose batch keeps changing would otherwise capture without end); a capture that fails turns
the graphs off for this engine (`failed` says why) and the plain launches go on. The capture
runs on a side stream of its own (no device-wide synchronize, no garbage collection:
torch.cuda.graph's entry does both), behind the current stream's work.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

WARM = 3
MAX_GRAPHS = 16
MAX_CAPTURES = 64


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
        self._graphs: OrderedDict[tuple, tuple] = OrderedDict()  # key -> (graph, argmax buffer)
        self._seen: OrderedDict[tuple, int] = OrderedDict()  # plain launches per buffers
        self._stream: torch.cuda.Stream | None = None
        self.failed: str | None = None
        self.stats = {"captures": 0, "replays": 0, "plain": 0}

    def run(self, logits: torch.Tensor, host: torch.Tensor, dev: torch.Tensor, R: int,
            n: int, W: int, argmax: bool | torch.Tensor = False) -> torch.Tensor | None:
        """Mask logits' rows (`plain`), from a graph once steady. argmax: the graph also
        writes the masked logits' argmax (N,) int64 into a buffer (this tensor, or with True
        one of its own), returned (None from a plain launch). A replay rewrites its buffer:
        the step's tokens must be consumed on the stream before the next replay (their copy
        to the host and the next step's input ids are queued before it)."""
        out = argmax if isinstance(argmax, torch.Tensor) else None
        key = (host.data_ptr(), dev.data_ptr(), R, n, W, logits.data_ptr(), logits.stride(0),
               tuple(logits.shape), logits.dtype, logits.device,
               out.data_ptr() if out is not None else bool(argmax))
        graph = self._graphs.get(key)
        if graph is None and self.failed is None and self.stats["captures"] < MAX_CAPTURES:
            seen = self._seen[key] = self._seen.pop(key, 0) + 1
            while len(self._seen) > 4 * MAX_GRAPHS:
                self._seen.popitem(last=False)
            if seen > WARM:  # (the kernel compiled, the buffers steady)
                del self._seen[key]
                graph = self._capture(logits, host, dev, R, n, W, out, key)
        if graph is None:
            plain(logits, host, dev, R, n, W)
            self.stats["plain"] += 1
            return None
        self._graphs.move_to_end(key)
        graph, out = graph
        graph.replay()
        self.stats["replays"] += 1
        return out

    def _capture(self, logits, host, dev, R, n, W, out, key) -> tuple | None:
        """(the graph, its argmax buffer or None), captured; None if the capture failed."""
        try:
            if key[-1] is not False:  # the greedy tokens too (compiled by a call first)
                from ..cuda_graph_runner import greedy_into

                if out is None:
                    out = torch.empty(logits.shape[0], dtype=torch.int64,
                                      device=logits.device)
                greedy_into(logits, out)
            here = torch.cuda.current_stream(logits.device)
            if self._stream is None:
                self._stream = torch.cuda.Stream(logits.device)
            side = self._stream
            side.wait_stream(here)  # (the logits it masks are written on `here`)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(side):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    plain(logits, host, dev, R, n, W)
                    if out is not None:
                        greedy_into(logits, out)
                finally:
                    graph.capture_end()
            here.wait_stream(side)
        except Exception as e:  # noqa: BLE001 - the plain launches go on, and say why
            self.failed = f"{type(e).__name__}: {e}"
            return None
        self.stats["captures"] += 1
        self._graphs[key] = graph, out
        while len(self._graphs) > MAX_GRAPHS:
            self._graphs.popitem(last=False)
        return graph, out
