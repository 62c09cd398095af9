"""How a step's masks get filled on the host: one by one on the engine's thread (grammars in
this process), or by the worker process that holds the grammars (mask_worker.py), which the
engine uses under async scheduling with CUDA graphs (`grammars_in_worker`).
The masks' layout, buffers and application are bitmask.py's."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .mask_worker import RemoteGrammar
from .state import FAILED


def grammars_in_worker(device: torch.device | str, async_scheduling: bool,
                       cuda_graph: bool) -> bool:
    """Whether an engine keeps its grammars in a worker process (mask_worker.py) rather than
    on its own thread: on a GPU, under async scheduling with CUDA-graph decoding.

    Why there only: such a step is short and host-bound (course model, batch 32, H200: ~0.7 ms
    a step), so the grammars' advance and fill (~15 us a row, ~0.5 ms for 32 rows) must leave
    the engine's thread, and a thread of the same process cannot take them: every hand-over
    passes the GIL and wakes a sleeping thread (100-200 us a step on GPU hosts). A process has
    its own interpreter; on an H200 host it gave 0.467x the unconstrained tokens/s against
    0.438x on the engine's thread and 0.317x with a helper thread. With eager launches or
    synchronous steps the step is longer and the engine's own thread was as fast or faster
    (eager async 1.11x, CUDA graphs synchronous 0.92x), and a process costs a core."""
    return torch.device(device).type == "cuda" and async_scheduling and cuda_graph


def fill_masks(states: Sequence, bitmask: torch.Tensor) -> None:
    """Row j of bitmask (R, W) int32 on the host <- states[j]'s allowed next tokens, one row
    at a time on this thread (llguidance drops the GIL inside each call); RemoteGrammar
    states: by their worker process, waited for."""
    rows = bitmask.numpy()
    if states and isinstance(states[0], RemoteGrammar):  # (the worker process fills them)
        states[0].worker.fill([s.slot for s in states], rows).result()
        return
    base, size = bitmask.data_ptr(), rows.shape[1] * 4  # (row j's address: no per-row
    for j, s in enumerate(states):  # numpy/ctypes objects)
        m = s._matcher or s.matcher  # (made on first use: waits for its compile)
        if m is FAILED:  # a grammar that did not compile: EOS only
            s.fill(rows[j])
        else:  # (a matcher in error or stopped writes an EOS-only row itself)
            m.unsafe_compute_mask_ptr(base + j * size, size)
