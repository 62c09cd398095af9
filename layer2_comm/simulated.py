"""One-shot and two-shot all-reduce over simulated ranks: the GPU algorithms, on a CPU.

On GPUs joined by NVLink every rank can load from and store to every other rank's buffer
(peer_all_reduce.py). Here the W ranks are simulated in one process: `PeerBuffers` holds one
buffer per rank and lets any rank read or write any of them, while it

- counts the bytes that cross from one rank to another (what NVLink would carry),
- counts barriers, and
- catches races: within one phase (the time between two barriers) a rank must not read a
  region another rank wrote, nor write a region another rank read or wrote. On real GPUs
  nothing orders two ranks' accesses except a barrier, so such code would read stale or
  half-written data some of the time; here it raises RaceError every time.

The algorithms are written phase by phase, each phase a loop over the ranks (they run one
after the other here, at once on GPUs), with `bufs.barrier()` between phases.

    one_shot_all_reduce:  copy in | barrier | every rank reads all W buffers and sums
                          1 barrier, each rank reads (W-1) n elements of its peers
    two_shot_all_reduce:  copy in | barrier | rank r sums segment r over all buffers and
                          writes it into every buffer | barrier | copy out
                          2 barriers, each rank reads and writes (W-1)/W n elements of peers
Sums are taken in rank order 0..W-1, so every rank gets the same bits.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .p2p import segment_bounds


class RaceError(RuntimeError):
    """Two ranks touched the same elements in one phase, with at least one write."""


class PeerBuffers:
    """`world` buffers of `numel` elements, one per simulated rank, shared by all ranks."""

    def __init__(self, world: int, numel: int, dtype: torch.dtype = torch.float32) -> None:
        if world < 1 or numel < 0:
            raise ValueError(f"need world >= 1 and numel >= 0, got {world}, {numel}")
        self.world, self.numel, self.dtype = world, numel, dtype
        self._data = [torch.zeros(numel, dtype=dtype) for _ in range(world)]
        self.phase = 0
        self.barriers = 0
        self.remote_read = [0] * world  # elements each rank read from other ranks' buffers
        self.remote_written = [0] * world  # elements each rank wrote into other ranks' buffers
        # per buffer and element, this phase's writer and readers (-1 / empty: none)
        self._writer = [torch.full((numel,), -1, dtype=torch.int64) for _ in range(world)]
        self._readers = [torch.zeros(numel, world, dtype=torch.bool) for _ in range(world)]

    def _span(self, who: int, owner: int, start: int, stop: int) -> None:
        for name, value in (("rank", who), ("owner", owner)):
            if not 0 <= value < self.world:
                raise ValueError(f"{name} {value} is not a rank of this world "
                                 f"(0..{self.world - 1})")
        if not 0 <= start <= stop <= self.numel:
            raise ValueError(f"[{start}:{stop}] is outside a buffer of {self.numel} elements")

    def read(self, reader: int, owner: int, start: int, stop: int) -> torch.Tensor:
        """Rank `reader` loads owner's buffer[start:stop] (a copy)."""
        self._span(reader, owner, start, stop)
        writers = self._writer[owner][start:stop]
        other = (writers >= 0) & (writers != reader)
        if bool(other.any()):
            who = int(writers[other][0])
            raise RaceError(f"rank {reader} reads rank {owner}'s buffer [{start}:{stop}] in the "
                            f"phase in which rank {who} wrote it: put a barrier between the write "
                            "and the read")
        self._readers[owner][start:stop, reader] = True
        if reader != owner:
            self.remote_read[reader] += stop - start
        return self._data[owner][start:stop].clone()

    def write(self, writer: int, owner: int, start: int, values: torch.Tensor) -> None:
        """Rank `writer` stores `values` into owner's buffer from `start`."""
        stop = start + values.numel()
        self._span(writer, owner, start, stop)
        writers = self._writer[owner][start:stop]
        readers = self._readers[owner][start:stop].clone()
        readers[:, writer] = False
        if bool(((writers >= 0) & (writers != writer)).any()) or bool(readers.any()):
            raise RaceError(f"rank {writer} writes rank {owner}'s buffer [{start}:{stop}] in a "
                            "phase in which another rank already read or wrote it: a barrier must "
                            "separate them")
        self._writer[owner][start:stop] = writer
        if writer != owner:
            self.remote_written[writer] += stop - start
        self._data[owner][start:stop] = values.reshape(-1).to(self.dtype)

    def barrier(self) -> None:
        """Every rank meets here: what was written before is visible to all after."""
        self.barriers += 1
        self.phase += 1
        for w, r in zip(self._writer, self._readers, strict=True):
            w.fill_(-1)
            r.fill_(False)


def _check(inputs: Sequence[torch.Tensor], bufs: PeerBuffers) -> tuple[int, int]:
    if not inputs:
        raise ValueError("need one input per rank, got none")
    first = inputs[0]
    for r, x in enumerate(inputs):
        if x.shape != first.shape or x.dtype != first.dtype:
            raise ValueError(f"rank {r} passed {tuple(x.shape)} {x.dtype}, rank 0 "
                             f"{tuple(first.shape)} {first.dtype}: every rank must all-reduce "
                             "the same size and dtype")
    if bufs.world != len(inputs) or bufs.numel < first.numel():
        raise ValueError(f"the buffers ({bufs.world} ranks x {bufs.numel} elements) do not fit "
                         f"{len(inputs)} inputs of {first.numel()} elements")
    return len(inputs), first.numel()


def _sum(parts: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Rank-order sum in fp32 (fp64 for fp64), cast back: the kernels' arithmetic."""
    acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    acc = torch.zeros_like(parts[0], dtype=acc_dtype)
    for part in parts:
        acc += part.to(acc_dtype)
    return acc.to(dtype)


def one_shot_all_reduce(inputs: Sequence[torch.Tensor],
                        bufs: PeerBuffers | None = None) -> list[torch.Tensor]:
    """inputs[r] is rank r's tensor; returns each rank's result (the sum over ranks)."""
    bufs = bufs or PeerBuffers(len(inputs), inputs[0].numel() if inputs else 0,
                               inputs[0].dtype if inputs else torch.float32)
    world, n = _check(inputs, bufs)
    for r in range(world):  # each rank publishes its input in its own buffer
        bufs.write(r, r, 0, inputs[r].reshape(-1))
    bufs.barrier()
    return [_sum([bufs.read(r, p, 0, n) for p in range(world)], inputs[r].dtype)
            .view(inputs[r].shape) for r in range(world)]


def two_shot_all_reduce(inputs: Sequence[torch.Tensor],
                        bufs: PeerBuffers | None = None) -> list[torch.Tensor]:
    """inputs[r] is rank r's tensor; returns each rank's result. Rank r reduces segment r
    (segment_bounds(n, W)[r]) and pushes it to every buffer, then everyone copies out."""
    bufs = bufs or PeerBuffers(len(inputs), inputs[0].numel() if inputs else 0,
                               inputs[0].dtype if inputs else torch.float32)
    world, n = _check(inputs, bufs)
    segments = segment_bounds(n, world)
    for r in range(world):
        bufs.write(r, r, 0, inputs[r].reshape(-1))
    bufs.barrier()
    for r in range(world):  # shot 1: reduce my segment; shot 2 starts at once: push it
        a, b = segments[r]
        total = _sum([bufs.read(r, p, a, b) for p in range(world)], inputs[r].dtype)
        for p in range(world):
            bufs.write(r, p, a, total)
    bufs.barrier()
    return [bufs.read(r, r, 0, n).view(inputs[r].shape) for r in range(world)]
