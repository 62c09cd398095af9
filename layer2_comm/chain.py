"""Pipelined chain broadcast.

The ranks form a line starting at the root: src -> src+1 -> ... -> src-1 (mod p). The
tensor is cut into `chunks` pieces. The root sends piece 0, then piece 1, ...; every other
rank, at each step, receives the next piece from its left while forwarding the piece it got
one step earlier to its right. Once the pipeline is full all p-1 links are busy at once.

    steps: chunks + p - 2      each rank sends n bytes once (the last sends nothing)
    time:  (chunks + p - 2) * (alpha + (n / chunks) * beta)

With chunks = 1 it is a bucket brigade, (p-1)(alpha + n beta): worse than the binomial
tree's ceil(log2 p)(alpha + n beta). With many chunks it approaches n beta — the
bandwidth of one link, independent of p — so for large tensors the chain beats the
tree, at the price of (chunks + p - 2) latencies. The best chunk count balances the two:
chunks ~ sqrt((p - 2) n beta / alpha).
(n counts bytes; alpha is per-message latency, beta seconds per byte.)
"""
from __future__ import annotations

import torch

from . import group
from .p2p import agree, exchange, flat, segment_bounds, write_back


def broadcast_chain(tensor: torch.Tensor, src: int = 0, *, chunks: int = 4) -> torch.Tensor:
    """Copy rank `src`'s `tensor` into every rank's `tensor` (same shape), in place."""
    p, me = group.world_size(), group.rank()
    if not 0 <= src < p:
        raise ValueError(f"src must be a rank in 0..{p - 1}, got {src}")
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive integer, got {chunks!r}")
    work = flat(tensor)
    v = (me - src) % p  # my place in the line; the root is 0
    prev = (me - 1) % p if v > 0 else None
    nxt = (me + 1) % p if v < p - 1 else None
    agree("broadcast_chain", work, [r for r in (prev, nxt) if r is not None],
          params=[("src", src), ("chunks", chunks)])
    if p == 1:
        return tensor
    pieces = [work[a:b] for a, b in segment_bounds(work.numel(), chunks)]
    lag = 0 if prev is None else 1  # the root has every piece already; others forward the last one
    for step in range(chunks + lag):
        recvs = [(pieces[step], prev)] if prev is not None and step < chunks else []
        out = step - lag
        sends = [(pieces[out], nxt)] if nxt is not None and 0 <= out < chunks else []
        # Receive piece `step` and send piece `step - lag` in one batch, then wait for both;
        # tags name the piece, so each receive matches the right message.
        exchange([(*s, out) for s in sends], [(*r, step) for r in recvs],
                 what="chain broadcast").wait()
    return write_back(tensor, work)
