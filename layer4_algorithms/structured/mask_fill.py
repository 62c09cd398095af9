"""How a step's masks get filled on the host: one by one on the engine's thread, on
llguidance's thread pool (opt-in: LLM_STACK_GRAMMAR_THREADS), or handed as one GIL-free call
to a helper thread that overlaps the engine's own work (LLM_STACK_MASK_OVERLAP; by default
whichever of the helper and the engine's thread the engine's timed steps find faster), or,
with LLM_STACK_MASK_OVERLAP=process, by the worker process that holds the grammars
(mask_worker.py).
The masks' layout, buffers and application are bitmask.py's."""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from statistics import median
from typing import TYPE_CHECKING

import torch

from .mask_graph import switch
from .mask_worker import RemoteGrammar
from .state import FAILED

if TYPE_CHECKING:
    import llguidance

_EXECUTORS: dict[tuple[int, int], llguidance.LLExecutor] = {}  # (pid, threads) ->
SERIAL_ROWS = 4  # with a pool, up to this many rows a step still fills on the calling thread


def fill_threads() -> int:
    """llguidance's pool threads for a batch's masks: LLM_STACK_GRAMMAR_THREADS (0 or 1: one
    by one on the calling thread; more than the CPUs: the CPUs), else 0.

    Why 0 by default: on an H200 host (64 CPUs, course model, V = 4096, batch 32) the pool
    never paid. Filling 32 mid-JSON rows back to back took 52.8 us on 1 pool thread, 60.1 on
    2, 93.7 on 4, 118.6 on 8; inside the engine (where, likely, the pool's threads have slept
    since the last step and must be woken every step) the fill took 0.5-1.8 ms a step on
    8 threads against 0.4 ms one by one on the engine's thread, and constrained decoding ran
    at 0.59x the unconstrained tokens/s instead of 0.93x (eager, async). A larger vocabulary
    costs more per row (the trie walk grows with V) and may tip the balance at large batches;
    that is not measured yet, so the pool is opt-in (a number here) rather than guessed at
    by a batch or vocabulary threshold. ValueError for a value that is not a whole number >= 0."""
    cpus = os.cpu_count() or 2
    env = os.environ.get("LLM_STACK_GRAMMAR_THREADS", "").strip()
    if env:
        try:
            n = int(env)
        except ValueError:
            n = -1
        if n < 0:
            raise ValueError(f"LLM_STACK_GRAMMAR_THREADS={env!r}: need a whole number of "
                             f"threads >= 0 (0 or 1: fill on the engine's thread)")
        return min(n, cpus)
    return 0


def mask_overlap() -> bool | str | None:
    """LLM_STACK_MASK_OVERLAP: 0 (or false/no/off) to fill every mask on the engine's thread;
    1 (or true/yes/on) for TokenMasks' helper thread whenever a step has enough constrained
    rows; process: the grammars in a worker process (mask_worker.py: every step's advance
    and fill leave this process); unset (or auto): None, the engine times the helper thread
    against its own and keeps the faster (`WayChooser`); ValueError for anything else."""
    env = os.environ.get("LLM_STACK_MASK_OVERLAP", "").strip().lower()
    on = switch(env)
    if on is not None:
        return on
    if env == "process":
        return "process"
    if env in ("", "auto"):
        return None
    raise ValueError(f"LLM_STACK_MASK_OVERLAP={env!r}: need 1, 0, process or auto")


class WayChooser:
    """Helper thread or the engine's own, chosen by timing the engine's steps with each.

    Which is faster depends on the host, not only on the fill: each hand-over between the
    engine's thread and the helper wakes a sleeping thread (and passes the GIL), which on a
    busy server took hundreds of microseconds a step; with a long step (eager launches) the
    fill hides behind the engine's work and the helper wins, with a short host-bound one (a
    small model under CUDA graphs) the hand-overs cost more than the fill they hide. So: the
    first steps that have a choice alternate in blocks of BLOCK (helper, own, helper, own),
    the way whose steps took less (median, a block's first 2 steps left out: they pay the
    switch) is kept for EVERY such steps, then they are timed again. `helper`: the way now."""

    BLOCK = 8
    EVERY = 512

    def __init__(self) -> None:
        self.helper = True
        self.chosen = 0  # times a way was chosen with the helper; `kept`: on the engine's
        self.kept = 0
        self._n = 0  # steps with a choice since the last timing began
        self._times: dict[bool, list[float]] = {True: [], False: []}

    def record(self, seconds: float) -> None:
        """One step that had the choice (made with `helper`) took `seconds`."""
        n, self._n = self._n, self._n + 1
        if n >= 4 * self.BLOCK:  # using the chosen way
            if self._n >= self.EVERY:  # time both again
                self._n, self._times, self.helper = 0, {True: [], False: []}, True
            return
        if n % self.BLOCK >= 2:
            self._times[self.helper].append(seconds)
        if (n + 1) % self.BLOCK == 0:
            self.helper = not self.helper
        if n + 1 == 4 * self.BLOCK:
            h, own = self._times[True], self._times[False]
            self.helper = not own or (bool(h) and median(h) <= median(own))
            self.chosen += self.helper
            self.kept += not self.helper


def executor(threads: int | None = None) -> llguidance.LLExecutor:
    """llguidance's thread pool for a batch's masks (one per thread count, made on first use;
    and again in a forked child, where the parent's pool threads do not exist)."""
    n = fill_threads() if threads is None else threads
    key = (os.getpid(), n)
    if key not in _EXECUTORS:
        from .grammar import llg

        _EXECUTORS[key] = llg().LLExecutor(max(1, n))
    return _EXECUTORS[key]


def fill_masks(states: Sequence, bitmask: torch.Tensor, threads: int | None = None) -> None:
    """Row j of bitmask (R, W) int32 on the host <- states[j]'s allowed next tokens: the
    healthy ones in one call on llguidance's threads, or one by one on this thread (threads
    0 or 1, or at most SERIAL_ROWS rows). threads: None for fill_threads()."""
    rows = bitmask.numpy()
    if states and isinstance(states[0], RemoteGrammar):  # (the worker process fills them)
        states[0].worker.fill([s.slot for s in states], rows).result()
        return
    n = fill_threads() if threads is None else threads
    healthy = fill_failed(states, rows)
    if n <= 1 or len(states) <= SERIAL_ROWS:  # (a pool of one thread only adds a hand-over)
        base, size = bitmask.data_ptr(), rows.shape[1] * 4  # (row j's address: no per-row
        for m, j in healthy:  # numpy/ctypes objects; llguidance drops the GIL here too)
            m.unsafe_compute_mask_ptr(base + j * size, size)
        return
    if healthy:
        executor(n).unsafe_compute_mask_ptr(healthy, bitmask.data_ptr(), rows.shape[1] * 4,
                                            rows.shape[0])


def fill_failed(states: Sequence, rows) -> list[tuple]:
    """Fill, here, the rows (numpy (R, W)) of the grammars that did not compile (EOS only);
    return (matcher, row) of the others, for llguidance to fill. Each matcher is made on
    first use (which waits for its compile). A matcher in error (it refused a token) or
    stopped is llguidance's to fill too: it writes an EOS-only row for it, so no call a row
    asks it here first."""
    healthy = []
    for j, s in enumerate(states):
        m = s._matcher or s.matcher
        if m is FAILED:
            s.fill(rows[j])
        else:
            healthy.append((m, j))
    return healthy


class FillHelper:
    """One thread that runs one GIL-free call at a time for the engine's thread.

    `run(fn, *args)` hands fn over and returns its Future once the helper has started it:
    the engine's thread waits (GIL released) until the helper is about to call fn, so the
    helper is not left waiting for the GIL behind the engine's Python (CPython hands it over
    only every few milliseconds to a thread that asks). fn must drop the GIL for its work
    (llguidance's executor does): the engine's thread then runs Python beside it, and the
    helper takes the GIL back to return only when the engine's thread blocks on the Future."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._job: tuple | None = None
        self._started = threading.Event()
        self.pid = os.getpid()  # the process whose thread it is
        threading.Thread(target=self._loop, name="token-masks", daemon=True).start()

    def run(self, fn, *args) -> Future:
        fut: Future = Future()
        self._started.clear()
        with self._cond:
            self._job = (fn, args, fut)
            self._cond.notify()
        self._started.wait()
        return fut

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._job is None:
                    self._cond.wait()
                fn, args, fut = self._job
                self._job = None
            self._started.set()
            t0 = time.perf_counter()
            try:
                fut.set_result((fn(*args), time.perf_counter() - t0))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting engine
                fut.set_exception(e)
