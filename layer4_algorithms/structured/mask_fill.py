"""How a step's masks get filled on the host: one row at a time on the engine's thread, each
at its row's address in the step's pinned arena. The masks' layout, buffers and application
are bitmask.py's.

Why on the engine's own thread, always: the other ways were built and measured on GPU hosts
(course model, batch 32, async scheduling with CUDA graphs, where the step is short and
host-bound) and lost. A helper thread paid more in GIL hand-overs (each wakes a sleeping
thread: 100-200 us a step) than the fill it hid (0.32x the unconstrained tokens/s against
0.44x); llguidance's thread pool lost to one row at a time at every size (its threads sleep
between steps); a worker process holding the grammars took the advance and fill off the
engine's thread, but its hand-over and its own slower fill made the engine wait (0.67-0.75x
against 0.85x on the engine's thread, once the apply replayed from a CUDA graph). The fill
runs after the step's forward is queued, so on a GPU it overlaps the forward's device time.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .state import FAILED


def fill_masks(states: Sequence, bitmask: torch.Tensor) -> None:
    """Row j of bitmask (R, W) int32 on the host <- states[j]'s allowed next tokens, one row
    at a time on this thread (llguidance drops the GIL inside each call)."""
    rows = bitmask.numpy()
    base, size = bitmask.data_ptr(), rows.shape[1] * 4  # (row j's address: no per-row
    for j, s in enumerate(states):  # numpy/ctypes objects)
        m = s._matcher or s.matcher  # (made on first use: waits for its compile)
        if m is FAILED:  # a grammar that did not compile: EOS only
            s.fill(rows[j])
        else:  # (a matcher in error or stopped writes an EOS-only row itself)
            m.unsafe_compute_mask_ptr(base + j * size, size)
