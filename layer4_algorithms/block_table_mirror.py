"""The running sequences' block tables mirrored in one numpy array (the model runner's).

A step's (B, n) block table is one numpy gather from this mirror instead of B Python lists
turned into a tensor each step; each sequence's row is kept in step with its list by copying
only what was appended since (or the whole row when the list was replaced).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class BlockTableMirror:
    """The running sequences' block tables as one (max_num_seqs, width) int64 array, row
    `seq.row` each, kept in step with the sequences' lists: a step's (B, n) table is one numpy
    gather instead of rebuilding it from B Python lists (~13k ids per step at 256 sequences
    of ~850 tokens). Relies on the block manager's contract: a table list only ever grows in
    place (appends); any other change (copy-on-write, truncation, freeing, admission, fork)
    gives the sequence a new list. A row is rewritten when its owner list changes, else only
    its new tail is copied."""

    def __init__(self, rows: int, width: int) -> None:
        self.table = np.zeros((rows, width), dtype=np.int64)
        self.owner: list[list[int] | None] = [None] * rows
        self.synced = [0] * rows

    def sync(self, seq) -> int:
        """Bring seq's row in step with its block-table list; returns the list's length, or -1
        when the sequence has no row or a table wider than the mirror."""
        r, t, table = seq.row, seq.block_table, self.table
        n = len(t)
        if r is None or r >= table.shape[0] or n > table.shape[1]:
            return -1
        m = self.synced[r]
        if self.owner[r] is not t or m > n:  # a new list: rewrite the row
            table[r, :n] = t
            table[r, n:] = 0
            self.owner[r], self.synced[r] = t, n
        elif m < n:  # appended since
            table[r, m:n] = t[m:]
            self.synced[r] = n
        return n

    def take(self, rows: list[int], lens: list[int],
             longest: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(B, longest) zero-padded table of the synced `rows`, and their lengths (longest:
        max(lens), if the caller knows it already)."""
        lens_np = np.array(lens, dtype=np.int64)
        if longest is None:
            longest = int(lens_np.max(initial=0))
        return self.table[np.array(rows, dtype=np.int64), :longest], lens_np

    def gather(self, seqs: Sequence) -> tuple[np.ndarray, np.ndarray] | None:
        """(B, longest) table of seqs (zero-padded) and their lengths; None when a sequence has
        no row or a table wider than the mirror (the caller builds the table itself)."""
        rows, lens = [], []
        for seq in seqs:
            n = self.sync(seq)
            if n < 0:
                return None
            rows.append(seq.row)
            lens.append(n)
        return self.take(rows, lens)

