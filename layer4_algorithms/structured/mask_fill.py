"""How a step's masks get filled on the host: each row at its row's address in the step's
pinned arena, by llguidance, on the engine's thread (one row at a time) or, with fill
threads, on llguidance's pool (all rows in one GIL-free call the engine's thread waits for).
The masks' layout, buffers and application are bitmask.py's.

Why the engine's thread waits for the fill instead of handing it over: the other ways were
built and measured on GPU hosts (course model, batch 32, async scheduling with CUDA graphs,
where the step is short and host-bound) and lost. A helper thread paid more in GIL
hand-overs (each wakes a sleeping thread: 100-200 us a step) than the fill it hid (0.32x the
unconstrained tokens/s against 0.44x); a worker process holding the grammars took the advance
and fill off the engine's thread, but its hand-over and its own slower fill made the engine
wait (0.67-0.75x against 0.85x on the engine's thread). The fill runs after the step's
forward is queued, so on a GPU it overlaps the forward's device time, but on a host-bound
step it adds to the step: 32 rows at ~10 us each are ~0.3-0.4 ms.

Why llguidance's pool once lost too, and what lanes try: its threads were handed rows that
were all copies of one compiled grammar, and the copies share one lexer behind one lock held
for a row's whole mask (grammar.py), so the threads queued on that lock (8 threads slower
than 1 at every size). With lanes each thread's rows hang off their own compile of the
schema: the rows are sorted by lane, so the pool's split of the list hands each thread
mostly one lane's rows. Measured once, on a 4x H200 host running three other jobs: inside
the engine (course model, CUDA graphs, async) the pool of 8 filled a step in 244 us against
322 us one row at a time (0.863x the unconstrained tokens/s against 0.781x), but 32 rows
spread over a document filled slower the more threads (1: 162 us, 2: 173, 4: 241, 8: 300)
and the Llama-3.2-1B-shape row lost (0.892x against 0.981x; its runs varied 3x). Not
proven, so off by default (EngineConfig.grammar_fill_threads=N turns it on); why more threads
stay slower over lanes is not known yet (something else llguidance shares, or that busy host).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .state import FAILED

# fewer rows fill one by one: waking the pool's threads (~10-30 us) costs more than it saves
POOL_MIN_ROWS = 4


def fill_masks(states: Sequence, bitmask: torch.Tensor, pool=None) -> None:
    """Row j of bitmask (R, W) int32 on the host <- states[j]'s allowed next tokens. pool:
    an llguidance LLExecutor: every row in one call on its threads (rows ordered by lane;
    at least POOL_MIN_ROWS rows); else one row at a time on this thread (llguidance drops
    the GIL inside each call)."""
    rows = bitmask.numpy()
    # row j's address (no numpy/ctypes object per row); a matcher is made on first use,
    # waiting for its compile
    base, size = bitmask.data_ptr(), rows.shape[1] * 4
    matchers = [s._matcher or s.matcher for s in states]
    if pool is not None and len(states) >= POOL_MIN_ROWS:
        order = sorted(range(len(states)), key=[s.lane for s in states].__getitem__)
        pairs = [(matchers[j], j) for j in order if matchers[j] is not FAILED]
        if pairs:
            pool.unsafe_compute_mask_ptr(pairs, base, size, len(states))
        for j, m in enumerate(matchers):
            if m is FAILED:  # a grammar that did not compile: EOS only
                states[j].fill(rows[j])
        return
    for j, m in enumerate(matchers):
        if m is FAILED:
            states[j].fill(rows[j])
        else:  # (a matcher in error or stopped writes an EOS-only row itself)
            m.unsafe_compute_mask_ptr(base + j * size, size)
