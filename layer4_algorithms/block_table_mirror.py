"""The running sequences' block tables mirrored in one numpy array (the model runner's).

A step's (B, n) block table is one numpy gather from this mirror instead of B Python lists
turned into a tensor each step; each sequence's row is kept in step with its list by copying
only what was appended since (or the whole row when the list was replaced). `sync_rows` finds
the few rows a step must touch with C-level loops (map, numpy) rather than a Python call per
sequence: most sequences added no block since the last step.
"""
from __future__ import annotations

from collections.abc import Sequence
from operator import is_

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
        self.synced = np.zeros(rows, dtype=np.int64)  # entries of each row copied so far
        self._rows: tuple[list, np.ndarray] = ([], np.zeros(0, dtype=np.int64))  # last step's

    def sync(self, seq) -> int:
        """Bring seq's row in step with its block-table list; returns the list's length, or -1
        when the sequence has no row or a table wider than the mirror."""
        r, t, table = seq.row, seq.block_table, self.table
        n = len(t)
        if r is None or r >= table.shape[0] or n > table.shape[1]:
            return -1
        m = int(self.synced[r])
        if self.owner[r] is not t or m > n:  # a new list: rewrite the row
            table[r, :n] = t
            table[r, n:] = 0
            self.owner[r], self.synced[r] = t, n
        elif m < n:  # appended since
            table[r, m:n] = t[m:]
            self.synced[r] = n
        return n

    def sync_rows(self, seqs: list) -> tuple[np.ndarray, np.ndarray] | None:
        """`sync` of every sequence in seqs: their rows and table lengths, (B,) int64 each; None
        when one has no row or a table wider than the mirror. A row is touched only when its
        sequence has a new list or a longer one (found without a Python call per sequence)."""
        rows = [q.row for q in seqs]
        if None in rows:
            return None
        tables = [q.block_table for q in seqs]
        lens = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
        if rows == self._rows[0]:  # the last step's rows (steady decoding): checked then
            rows_np = self._rows[1]
        else:
            rows_np = np.array(rows, dtype=np.int64)
            if len(rows) and rows_np.max() >= self.table.shape[0]:
                return None
            self._rows = rows, rows_np
        if len(rows) and lens.max() > self.table.shape[1]:
            return None
        stale = self.synced[rows_np] != lens
        if not all(map(is_, map(self.owner.__getitem__, rows), tables)):  # a list replaced
            stale |= ~np.fromiter(map(is_, map(self.owner.__getitem__, rows), tables),
                                  dtype=bool, count=len(rows))
        for i in np.flatnonzero(stale).tolist():
            self.sync(seqs[i])
        return rows_np, lens

    def gather(self, seqs: Sequence) -> tuple[np.ndarray, np.ndarray] | None:
        """(B, longest) table of seqs (zero-padded) and their lengths; None when a sequence has
        no row or a table wider than the mirror (the caller builds the table itself)."""
        got = self.sync_rows(list(seqs))
        if got is None:
            return None
        rows, lens = got
        return self.table[rows, :int(lens.max(initial=0))], lens
