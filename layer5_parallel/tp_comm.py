"""The collectives tensor parallelism needs, over a selectable backend.

A tensor-parallel forward uses three collectives, always over every rank of the group:
- all_reduce(x): the sum of every rank's x, in place (row-parallel outputs, the embedding);
- all_gather(x): every rank's (n, ...) stacked in rank order -> (world, n, ...) (the logits);
- broadcast(x): rank 0's x into every rank's x (the step's token ids and slots).

Backends:
- "torch": torch.distributed's own collectives (NCCL on GPUs, gloo on CPUs). The fast path.
- "ours": layer 2's collectives built from send/recv (`ring_all_reduce`, `ring_all_gather`,
  `broadcast_tree`). Each swaps a header with its peers first, so ranks that disagree on a
  tensor's size get a ValueError naming both instead of garbage or a hang.
`check=True` gives the torch backend the same guard: before each collective every rank
all-gathers (numel, dtype) and raises ValueError on a mismatch (one more small collective).

Both wait at most the process group's timeout (layer 2's `init(timeout_s=...)`).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

import layer4_algorithms as engine

COMM_BACKENDS = ("torch", "ours")
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int64: 3,
                torch.int32: 4, torch.float64: 5}


class TPComm:
    """Collectives over the default process group (its rank and world size)."""

    def __init__(self, backend: str = "torch", *, check: bool = False) -> None:
        if backend not in COMM_BACKENDS:
            raise ValueError(f"comm backend must be one of {COMM_BACKENDS}, got {backend!r}")
        self.backend, self.check = backend, check
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # counted for the reports: calls, bytes, and host seconds inside collectives (the
        # time itself on gloo, which is synchronous; under NCCL only the time to queue them)
        self.calls, self.bytes, self.seconds = 0, 0, 0.0

    def _count(self, x: torch.Tensor) -> None:
        self.calls += 1
        self.bytes += x.numel() * x.element_size()

    def _agree(self, what: str, x: torch.Tensor) -> None:
        """ValueError on every rank when the ranks pass tensors of different numel or dtype."""
        mine = torch.tensor([x.numel(), _DTYPE_CODES.get(x.dtype, 9)], dtype=torch.int64)
        if x.is_cuda:
            mine = mine.to(x.device)
        every = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(every, mine)
        rows = [tuple(t.tolist()) for t in every]
        if len(set(rows)) > 1:
            detail = ", ".join(f"rank {r}: numel {n} dtype code {d}"
                               for r, (n, d) in enumerate(rows))
            raise ValueError(f"{what}: ranks passed different tensors ({detail}); every rank of a "
                             "tensor-parallel group must run the same step on the same shapes")

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place; returns x."""
        self._count(x)
        if self.backend == "ours":
            return engine.executor.comm.ring_all_reduce(x)
        if self.check:
            self._agree("all_reduce", x)
        dist.all_reduce(x)
        return x

    def _all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """x (n, ...) on every rank -> (world, n, ...), rank r's x at [r]."""
        self._count(x)
        x = x.contiguous()
        if self.backend == "ours":
            return engine.executor.comm.ring_all_gather(x).view(self.world, *x.shape)
        if self.check:
            self._agree("all_gather", x)
        out = x.new_empty((self.world, *x.shape))
        dist.all_gather(list(out.unbind(0)), x)
        return out

    def _broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x into every rank's x (same shape everywhere), in place; returns x."""
        self._count(x)
        if self.backend == "ours":
            return engine.executor.comm.broadcast_tree(x, 0)
        if self.check:
            self._agree("broadcast", x)
        dist.broadcast(x, 0)
        return x

    def _timed(self, fn, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        try:
            return fn(x)
        finally:
            self.seconds += time.perf_counter() - start

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place; returns x."""
        return self._timed(self._all_reduce, x)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """x (n, ...) on every rank -> (world, n, ...), rank r's x at [r]."""
        return self._timed(self._all_gather, x)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x into every rank's x (same shape everywhere), in place; returns x."""
        return self._timed(self._broadcast, x)
