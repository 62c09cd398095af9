"""A decode graph's context inputs, written by the host where the graph reads them.

A CUDA graph reads its inputs from the addresses it was captured with, so each step's
positions, sequence lengths and block tables must land in static buffers. Taken there as
tensors, that is one copy to the device (from pinned memory) and then three device copies
into the static buffers, plus four fills when the step's bucket has padding rows: up to eight
launches for a few hundred bytes. Here positions, seq_lens, a gather index and the input ids
are the four quarters of one device tensor, `positions | seq_lens | gather | input_ids` (rows,
each), and the host writes a step's values and its bucket's padding rows into a pinned array
of the same layout, then copies it in one go: positions and seq_lens, and the ids too when the
step's input tokens are on the host (synchronous steps, a pipeline's lanes: no copy of their
own and no device copy into the graph's ids), or the rows of the last step's tokens they are
when those are on the device in another order (a sequence finished or joined: the gather's
index rides along instead of a copy of its own); ids in place stay out of it. The
block tables go as the bucket's (bucket, n) rows (n: the step's widest table, not the graph's
max_blocks, which follows max_model_len), padding rows pointing at the scratch block, in one
more copy, which is skipped when the device holds those very rows already (steady decoding:
the same sequences in the same rows, no block added since; a table changes once every
block_size steps of a sequence). The views each copy needs are made once per shape. Rows
past the bucket and table columns past a row's n keep stale values: the step never reads
them (every position < seq_lens <= n * block_size; a padding row reads column 0), and a
step of a bigger bucket writes its rows first. The pinned arrays are double-buffered (a copy
reads its array when it runs: an array is refilled only once its previous copy has run, as
layer 3's HostStaging does). On a CPU the host writes straight into the static buffers.
"""
from __future__ import annotations

import numpy as np
import torch

from .cuda_events import record


class GraphInputs:
    """positions, seq_lens, gather, input_ids (rows,) and block_tables (rows, max_blocks) int64
    on `device`, every row padding to start with (position 0, length 1, token 0, the scratch
    block). `load(B, bucket, pos, table[, ids | gather])` fills rows [0, bucket) from the host
    (gather: only its first B rows, for the caller's gather of the ids). copies:
    through host arrays and copies (default: on a GPU; a CPU test may ask for it: no pinning,
    no events)."""

    def __init__(self, rows: int, max_blocks: int, scratch: int, device: torch.device, *,
                 copies: bool | None = None) -> None:
        self.rows, self.scratch = rows, scratch
        self.lens_buffer = torch.zeros(4 * rows, dtype=torch.int64, device=device)
        self.positions, self.seq_lens, self.gather, self.input_ids = self.lens_buffer.view(4, rows)
        self.block_tables = torch.zeros((rows, max_blocks), dtype=torch.int64, device=device)
        self.pinned = device.type == "cuda"
        self.copies = self.pinned if copies is None else copies
        self._events: list[torch.cuda.Event | None] = [None, None]
        if self.copies:  # two of each: [positions | seq_lens | gather | ids], the tables' rows
            self._lens_t = [torch.zeros(4 * rows, dtype=torch.int64, pin_memory=self.pinned)
                            for _ in range(2)]
            self._tables_t: list[torch.Tensor | None] = [None, None]  # grown on demand
        else:  # the static buffers themselves
            self._lens_t = [self.lens_buffer]
            self._cpu_tables = self.block_tables.numpy()
        self._lens = [t.numpy() for t in self._lens_t]
        for h in self._lens:
            h[:rows], h[rows:2 * rows] = 0, 1
        self.block_tables.fill_(scratch)
        self._turn = 0
        self._views: dict[tuple, tuple] = {}  # cached views per (turn, length[, n])
        self._last: tuple | None = None  # (bucket, shape, ids) of the tables the device holds

    def load(self, B: int, bucket: int, pos: np.ndarray, table: np.ndarray,
             ids: np.ndarray | None = None, gather: np.ndarray | None = None) -> None:
        """Rows [0, B): positions pos (B,), seq_lens pos + 1, block tables table (B, n) with
        n <= max_blocks, and input ids `ids` (B,) or a gather index `gather` (B,) when given
        (the device's input_ids are left as they are); rows [B, bucket) padding; on the device
        in stream order."""
        n = table.shape[1]
        if not self.copies:
            self._fill(self._lens[0], B, bucket, pos, ids, gather)
            t = self._cpu_tables
            t[:B, :n] = table
            t[B:bucket, :n] = self.scratch
            return
        turn = self._turn
        self._turn = 1 - turn
        ev = self._events[turn]
        if ev is not None:  # this turn's copies of two steps ago have run (long since)
            ev.synchronize()
        size = self._fill(self._lens[turn], B, bucket, pos, ids, gather)
        views = self._views.get((turn, size))
        if views is None:
            views = self._views[(turn, size)] = (self.lens_buffer[:size],
                                                 self._lens_t[turn][:size])
        views[0].copy_(views[1], non_blocking=True)
        key = (bucket, table.shape, table.tobytes())
        if key != self._last:
            # the tables' (bucket, n) block, unless the device holds it already (steady
            # decoding: same sequences in the same rows, no new block since the last step)
            rows_np, rows_t, dst = self._table_views(turn, bucket, n)
            rows_np[:B] = table
            if B < bucket:
                rows_np[B:] = self.scratch
            dst.copy_(rows_t, non_blocking=True)
            self._last = key
        if self.pinned:
            if ev is None:
                ev = self._events[turn] = torch.cuda.Event()
            record(ev)

    def _fill(self, h: np.ndarray, B: int, bucket: int, pos: np.ndarray,
              ids: np.ndarray | None, gather: np.ndarray | None) -> int:
        """Write a step's rows [0, B) and its bucket's padding rows into the host layout h;
        returns how many of h's leading entries the device needs: positions for every row,
        seq_lens up to the bucket's; with a gather index or host ids, every seq_len and those
        (padding rows keep their ids: valid, outputs never read)."""
        r = self.rows
        h[:B] = pos
        np.add(pos, 1, out=h[r:r + B])
        if B < bucket:
            h[B:bucket], h[r + B:r + bucket] = 0, 1
        size = r + bucket
        if gather is not None:
            h[2 * r:2 * r + B] = gather
            size = 2 * r + B
        if ids is not None:
            h[3 * r:3 * r + B] = ids
            size = 3 * r + B
        return size

    def forget(self) -> None:
        """Someone else wrote the static tables: the next load copies its rows again."""
        self._last = None

    def _table_views(self, turn: int, bucket: int, n: int):
        """This turn's pinned (bucket, n) rows (numpy and tensor) and their place on the
        device, kept per shape (a step's shapes repeat: n grows by one every block_size
        tokens)."""
        key = (turn, bucket, n)
        views = self._views.get(key)
        if views is None:
            if len(self._views) > 512:  # many shapes seen: start over
                self._views = {}
            rows_t = self._tables(turn, bucket * n).view(bucket, n)
            views = self._views[key] = (rows_t.numpy(), rows_t,
                                        self.block_tables[:bucket, :n])
        return views

    def _tables(self, turn: int, size: int) -> torch.Tensor:
        """This turn's pinned table rows, at least `size` long (grown: its copies have run)."""
        buf = self._tables_t[turn]
        if buf is None or buf.numel() < size:
            buf = self._tables_t[turn] = torch.empty(max(2 * size, 4096), dtype=torch.int64,
                                                     pin_memory=self.pinned)
            self._views = {k: v for k, v in self._views.items() if len(k) == 2}  # (old rows)
        return buf[:size]

