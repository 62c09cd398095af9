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

from .packed_ints import packed


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
        self.synced = [0] * rows  # entries of each row copied so far
        self._rows: tuple[list, slice | np.ndarray] = ([], slice(0, 0))  # the last step's
        self._last: tuple[list, tuple] | None = None  # (seqs, sync_rows' answer) of the last sync

    def sync(self, seq) -> int:
        """Bring seq's row in step with its block-table list; returns the list's length, or -1
        when the sequence has no row or a table wider than the mirror."""
        r, t, table = seq.row, seq.block_table, self.table
        n = len(t)
        if r is None or r >= table.shape[0] or n > table.shape[1]:
            return -1
        m = self.synced[r]
        if self.owner[r] is not t or m > n:  # a new list: rewrite the row
            # (a long list through fromiter: half the instructions of numpy's per-item
            # discovery; a 2k-token prompt's ~128 blocks)
            table[r, :n] = np.fromiter(t, np.int64, n) if n > 32 else t
            table[r, n:] = 0
            self.owner[r], self.synced[r] = t, n
        elif m < n:  # appended since
            table[r, m:n] = t[m:]
            self.synced[r] = n
        return n

    def sync_rows(self, seqs: list, unchanged: bool = False
                  ) -> tuple[slice | np.ndarray, list[int]] | None:
        """`sync` of every sequence in seqs: where their rows are (`table[where]`: a slice when
        the rows are consecutive, so the step's table is a view; else a row array) and their
        table lengths; None when one has no row or a table wider than the mirror. Whether
        any row needs a sync is checked with map() over the step (C-level loops); only those
        that do are touched. unchanged: the caller knows no table of seqs changed since they
        were last synced (a step of plain decodes): when seqs are the last call's, in order
        (one identity comparison), its answer is returned as it is."""
        last = self._last
        if unchanged and last is not None and seqs == last[0]:
            return last[1]
        rows = [q.row for q in seqs]
        if None in rows:
            return None
        tables = [q.block_table for q in seqs]
        lens = list(map(len, tables))
        if rows != self._rows[0]:  # (else the last step's rows, checked then)
            if rows and max(rows) >= self.table.shape[0]:
                return None
            first = rows[0] if rows else 0
            consecutive = rows == list(range(first, first + len(rows)))
            self._rows = rows, (slice(first, first + len(rows)) if consecutive
                                else np.array(rows, dtype=np.int64))
        if lens and max(lens) > self.table.shape[1]:
            return None
        owner, synced = self.owner, self.synced
        if (list(map(synced.__getitem__, rows)) != lens
                or not all(map(is_, map(owner.__getitem__, rows), tables))):
            for q in [q for q, r, t, n in zip(seqs, rows, tables, lens, strict=True)
                      if owner[r] is not t or synced[r] != n]:
                self.sync(q)
        answer = self._rows[1], lens
        self._last = (seqs, answer)
        return answer

    def gather(self, seqs: Sequence) -> tuple[np.ndarray, np.ndarray] | None:
        """(B, longest) table of seqs (zero-padded) and their lengths; None when a sequence has
        no row or a table wider than the mirror (the caller builds the table itself)."""
        got = self.sync_rows(list(seqs))
        if got is None:
            return None
        where, lens = got
        return self.table[where, :max(lens, default=0)].copy(), np.array(lens, dtype=np.int64)

    def row_of(self, seq) -> tuple[np.ndarray, np.ndarray] | None:
        """gather([seq]) without syncing seq's row (its list then stays new to the mirror: the
        first step that gathers or syncs it writes the row whole): for a step whose table no
        later step reuses as it is, a fresh prompt's prefill (~128 ids of a 2k-token prompt;
        the sync and the gather's copy cost a few times the list's one conversion)."""
        t, r = seq.block_table, seq.row
        n = len(t)
        if r is None or r >= self.table.shape[0] or n > self.table.shape[1]:
            return None
        table = packed(t).reshape(1, n)  # (read-only, read once)
        return table, np.array([n], dtype=np.int64)
