"""TokenMasks' fill on the helper thread (a mixin of bitmask.py's TokenMasks): whether a step
takes it (`use_helper`, timed by mask_fill.py's WayChooser unless LLM_STACK_MASK_OVERLAP says),
the hand-over of a step's healthy rows as one GIL-free call of llguidance's executor (`submit`),
the wait for it (`wait`), and the wait for a fill started before the step's rows were known,
mapped onto them (`wait_ahead`)."""
from __future__ import annotations

import os
import time
from collections.abc import Sequence
from concurrent.futures import Future

from .mask_fill import FillHelper, executor, fill_failed
from .mask_worker import RemoteGrammar


class HelperFill:
    """For TokenMasks: reads self.overlap, self.chooser, self.threads, self.W, self.stats,
    self._helper, self._asked; calls self._arena_for."""

    def use_helper(self) -> bool:
        """Whether a step with at least overlap_rows constrained rows hands its fill to the
        helper: `overlap` if set, else the chooser's way (the step is then timed for it)."""
        if self.overlap is not None:
            return bool(self.overlap)
        self._asked = True
        return self.chooser.helper

    def end_step(self, seconds: float) -> None:
        """The engine's step took `seconds`: counted for the chooser's way if it asked."""
        if self._asked:
            self._asked = False
            self.chooser.record(seconds)

    def submit(self, seqs: Sequence) -> Future | None:
        """`prepare` with the fill on the helper thread: this thread readies the arena (and
        the rows of failed grammars, EOS only) and hands the healthy rows over in one call of
        llguidance's executor, which drops the GIL; returns a Future of what `launch` needs
        (None: no constrained row). The grammars must not advance until `wait` returns."""
        t0 = time.perf_counter()
        got = self._arena_for(seqs)
        if got is None:
            return None
        states, rows, prepared = got
        R, W = prepared[0], self.W
        rows = rows.numpy()
        if isinstance(states[0], RemoteGrammar):  # the worker process advances and fills
            fut = states[0].worker.fill([s.slot for s in states], rows)
            self.stats["fill_s"] += time.perf_counter() - t0
            return _Submitted(fut, prepared)
        healthy = fill_failed(states, rows)
        if self._helper is None or self._helper.pid != os.getpid():  # (a forked child: anew)
            self._helper = FillHelper()
        fut = None
        if healthy:
            fut = self._helper.run(executor(max(1, self.threads or 1)).unsafe_compute_mask_ptr,
                                   healthy, rows.ctypes.data, W * 4, R)
        self.stats["fill_s"] += time.perf_counter() - t0
        return _Submitted(fut, prepared)

    def wait(self, submitted: _Submitted | None) -> tuple | None:
        """The prepared arena of `submit`, once the helper has filled it (the time waited is
        counted in stats["wait_s"], the helper's fill in stats["helper_s"])."""
        if submitted is None:
            return None
        if submitted.future is not None:
            t0 = time.perf_counter()
            _, took = submitted.future.result()
            self.stats["wait_s"] += time.perf_counter() - t0
            self.stats["helper_s"] += took
        return submitted.prepared

    def wait_ahead(self, submitted: _Submitted | None, filled: Sequence,
                   seqs: Sequence) -> tuple | None:
        """`wait` for a fill submitted before this step's rows were known (filled: the
        sequences of its rows, in order), mapped onto seqs (row i for seqs[i]). The same
        constrained sequences in the same order (a steady batch) keep the filled arena: only
        their logits rows are written; otherwise the filled rows are copied into the next
        arena and the others (a grammar's first token, a fork) filled here."""
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
        for j, i in enumerate(idx):
            k = where.get(id(seqs[i]))
            if k is not None and old is not None:
                rows[j] = old[k]
            else:
                states[j].fill(rows[j])
        self.stats["ahead_remapped"] += 1
        self.stats["fill_s"] += time.perf_counter() - t0
        return new


class _Submitted:
    """A fill handed to the helper: its Future (None: no healthy row to fill) and the arena."""

    __slots__ = ("future", "prepared")

    def __init__(self, future: Future | None, prepared: tuple) -> None:
        self.future = future
        self.prepared = prepared
