"""A decode graph's context inputs in one static buffer, filled from the host in one copy.

A CUDA graph reads its inputs from the addresses it was captured with, so each step's
positions, sequence lengths and block tables must land in static buffers. Taking them there
as three tensors costs the host, every step, one copy to the device (from pinned memory) and
then three device copies into the static buffers, plus four fills when the step's bucket has
padding rows: up to eight launches for a few hundred bytes. Here the three buffers are views
of one device tensor,

    positions (rows,) | seq_lens (rows,) | block_tables (rows, max_blocks)

and the host writes a step's values, and its bucket's padding rows, into a host array of the
same layout, then copies the span the bucket reads in one go (one launch). Rows past the
bucket and table columns past a row's blocks keep stale values: the step never reads them
(every position < seq_lens <= blocks * block_size), and a step of a bigger bucket writes its
rows first. On a GPU the host array is pinned and double-buffered (the copy reads it when it
runs: a buffer is refilled only after its previous copy ran, as layer 3's HostStaging does);
on a CPU the host array is the static buffer itself, and nothing is copied.
"""
from __future__ import annotations

import numpy as np
import torch


class GraphInputs:
    """positions, seq_lens (rows,) and block_tables (rows, max_blocks) int64 on `device`: views
    of one buffer. Every row starts as padding (position 0, length 1, the scratch block).
    `load(B, bucket, pos, table)` fills rows [0, bucket) from the host."""

    def __init__(self, rows: int, max_blocks: int, scratch: int, device: torch.device) -> None:
        self.rows, self.max_blocks, self.scratch = rows, max_blocks, scratch
        size = rows * (2 + max_blocks)
        self.buffer = torch.zeros(size, dtype=torch.int64, device=device)
        self.positions = self.buffer[:rows]
        self.seq_lens = self.buffer[rows:2 * rows]
        self.block_tables = self.buffer[2 * rows:].view(rows, max_blocks)
        self.copies = device.type == "cuda"
        host = [torch.zeros(size, dtype=torch.int64, pin_memory=True) for _ in range(2)] \
            if self.copies else [self.buffer]
        self._host = [self._views(t.numpy()) for t in host]
        self._host_t = host
        self._events: list[torch.cuda.Event | None] = [None] * len(host)
        self._turn = 0
        for views in self._host:  # every row padding, as the device's
            self._pad(views, 0, rows)

    def _views(self, flat: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        r = self.rows
        return flat[:r], flat[r:2 * r], flat[2 * r:].reshape(r, self.max_blocks)

    def _pad(self, views, start: int, stop: int) -> None:
        """Rows [start, stop) of a host array: one token at position 0 in the scratch block."""
        pos, lens, table = views
        pos[start:stop] = 0
        lens[start:stop] = 1
        table[start:stop] = self.scratch

    def load(self, B: int, bucket: int, pos: np.ndarray, table: np.ndarray) -> None:
        """Rows [0, B): positions pos (B,), seq_lens pos + 1, block tables table (B, n) with
        n <= max_blocks; rows [B, bucket) padding; on the device in stream order."""
        turn = self._turn
        views = self._host[turn]
        if self.copies:
            self._turn = 1 - turn
            ev = self._events[turn]
            if ev is not None:  # this buffer's copy of two steps ago has run (long since)
                ev.synchronize()
        h_pos, h_lens, h_table = views
        h_pos[:B] = pos
        np.add(pos, 1, out=h_lens[:B])
        h_table[:B, :table.shape[1]] = table
        if B < bucket:
            self._pad(views, B, bucket)
        if not self.copies:
            return
        span = 2 * self.rows + bucket * self.max_blocks  # what the bucket's step reads
        self.buffer[:span].copy_(self._host_t[turn][:span], non_blocking=True)
        ev = self._events[turn]
        if ev is None:
            ev = self._events[turn] = torch.cuda.Event()
        ev.record()
