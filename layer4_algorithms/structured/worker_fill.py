"""TokenMasks' fill in the grammar worker process (a mixin of bitmask.py's TokenMasks): the
hand-over of a step's queued tokens and rows as one message (`submit`), the wait for the rows
(`wait`), and the wait for a fill started before the step's rows were known, mapped onto them
(`wait_ahead`)."""
from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from .mask_fill import fill_masks
from .mask_worker import RemoteGrammar


class WorkerFill:
    """For TokenMasks: reads self.W, self.stats; calls self._arena_for."""

    def submit(self, seqs: Sequence) -> _Submitted | None:
        """`prepare` with the fill in the worker process: this thread readies the arena and
        sends the queued tokens and the rows to fill in one message; returns a handle of what
        `launch` needs (None: no constrained row). The grammars must not advance until `wait`
        returns. (The states must be the worker's: RemoteGrammar.)"""
        t0 = time.perf_counter()
        got = self._arena_for(seqs)
        if got is None:
            return None
        states, rows, prepared = got
        if not isinstance(states[0], RemoteGrammar):
            raise TypeError("TokenMasks.submit hands rows to the grammar worker process: "
                            "these grammars are in this process (fill them with prepare)")
        fut = states[0].worker.fill([s.slot for s in states], rows.numpy())
        self.stats["fill_s"] += time.perf_counter() - t0
        return _Submitted(fut, prepared)

    def wait(self, submitted: _Submitted | None) -> tuple | None:
        """The prepared arena of `submit`, once the worker has filled it (the time waited is
        counted in stats["wait_s"], the worker's own time in stats["worker_s"])."""
        if submitted is None:
            return None
        t0 = time.perf_counter()
        _, took = submitted.future.result()
        self.stats["wait_s"] += time.perf_counter() - t0
        self.stats["worker_s"] += took
        return submitted.prepared

    def wait_ahead(self, submitted: _Submitted | None, filled: Sequence,
                   seqs: Sequence) -> tuple | None:
        """`wait` for a fill submitted before this step's rows were known (filled: the
        sequences of its rows, in order), mapped onto seqs (row i for seqs[i]). The same
        constrained sequences in the same order (a steady batch) keep the filled arena: only
        their logits rows are written; otherwise the filled rows are copied into the next
        arena and the others (a grammar's first token, a fork) filled with one more request."""
        prepared = self.wait(submitted)
        idx = [i for i, q in enumerate(seqs) if getattr(q, "grammar", None) is not None]
        W = self.W
        if prepared is not None and len(idx) == len(filled) and all(
                seqs[i] is q for i, q in zip(idx, filled, strict=True)):
            R, _, _, host, _ = prepared
            host.numpy()[R * W:R * W + R] = idx
            self.stats["ahead"] += 1
            return prepared
        t0 = time.perf_counter()
        got = self._arena_for(seqs)
        if got is None:
            return None
        states, rows, new = got
        rows = rows.numpy()
        where = {id(q): k for k, q in enumerate(filled)}
        old = prepared[3].numpy()[:prepared[0] * W].reshape(-1, W) if prepared else None
        missing = []
        for j, i in enumerate(idx):
            k = where.get(id(seqs[i]))
            if k is not None and old is not None:
                rows[j] = old[k]
            else:
                missing.append(j)
        if missing:
            part = torch.empty((len(missing), W), dtype=torch.int32)
            fill_masks([states[j] for j in missing], part)
            rows[missing] = part.numpy()
        self.stats["ahead_remapped"] += 1
        self.stats["fill_s"] += time.perf_counter() - t0
        return new


class _Submitted:
    """A fill handed to the worker: the handle of its reply and the arena."""

    __slots__ = ("future", "prepared")

    def __init__(self, future, prepared: tuple) -> None:
        self.future = future
        self.prepared = prepared
