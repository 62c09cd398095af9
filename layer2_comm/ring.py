"""Ring collectives: all-reduce = reduce-scatter, then all-gather.

The p ranks stand in a ring; each sends only to its right-hand neighbour and receives
only from its left-hand one, so every link carries the same load and no rank is a hot spot.
The n-element tensor is cut into p segments (sizes differ by at most one element, so any n
works, including n < p, where some segments are empty).

Reduce-scatter, p-1 steps. At step k rank i sends segment (i-k-1) mod p — its running
partial sum of that segment — and receives segment (i-k-2) mod p, which it adds to its
own copy. Each segment travels once around the ring, picking up one contribution per hop,
and after the last step rank i holds segment i reduced over all ranks.
    bytes sent per rank: (p-1)/p * n     time: (p-1) alpha + (p-1)/p * n beta

All-gather, p-1 steps. Rank i starts with segment i; at step k it forwards segment
(i-k) mod p (the one it received last step) and receives segment (i-k-1) mod p.
    bytes sent per rank: (p-1)/p * n     time: (p-1) alpha + (p-1)/p * n beta

All-reduce is both:  2(p-1) alpha + 2(p-1)/p * n beta.  The bandwidth term does not grow
with p: the ring is bandwidth-optimal, which is why NCCL uses it for large messages; the
latency term grows linearly, which is why small messages prefer a tree (tree.py).

Pipelining (`chunks`): each segment is cut again into `chunks` pieces and the ring moves
pieces, keeping up to `chunks` of them in flight — piece c+1 is on the wire while piece c is
being added. The step count becomes chunks*(p-1) per phase (more alpha), in exchange for
overlapping the additions and the two directions of each link.
(n above counts bytes; alpha is per-message latency, beta seconds per byte.)
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import torch

from . import group
from .p2p import (
    Pending,
    agree,
    check_op,
    exchange,
    flat,
    reduce_into,
    ring_neighbours,
    segment_bounds,
    write_back,
)


def _pieces(bounds: Sequence[tuple[int, int]], chunks: int) -> list[list[tuple[int, int]]]:
    """Each segment's `chunks` sub-ranges, in absolute offsets."""
    return [[(a + s, a + e) for s, e in segment_bounds(b - a, chunks)] for a, b in bounds]


def _pipeline(count: int, chunks: int, issue: Callable[[int], Pending],
              finish: Callable[[int], None]) -> None:
    """Issue items 0..count-1 in order, keeping at most `chunks` in flight.

    Item i may depend on item i - chunks (the same piece one step earlier), so that one is
    finished (waited for and reduced) before item i is issued.
    """
    inflight: deque[tuple[int, Pending]] = deque()
    for i in range(count):
        while inflight and inflight[0][0] <= i - chunks:
            j, pending = inflight.popleft()
            pending.wait()
            finish(j)
        inflight.append((i, issue(i)))
    while inflight:
        j, pending = inflight.popleft()
        pending.wait()
        finish(j)


def reduce_scatter_phase(src: torch.Tensor, op: str, ranks: Sequence[int],
                         bounds: Sequence[tuple[int, int]], chunks: int = 1,
                         out: torch.Tensor | None = None, tag: int = 0) -> None:
    """The ring reduce-scatter over `ranks` (global ranks, in ring order) of flat `src`.

    With out=None it works in place: afterwards src[bounds[i]] on ranks[i] holds the
    reduced segment (other segments hold partial sums). Otherwise `src` is only read and
    `out` (the size of my segment) receives the result. "avg" only sums here.
    """
    p, me = len(ranks), group.rank()
    i = ranks.index(me)
    if p == 1:
        if out is not None:
            out.copy_(src[bounds[0][0]:bounds[0][1]])
        return
    prev, nxt = ring_neighbours(ranks, me)
    pieces = _pieces(bounds, chunks)
    largest = max(b - a for seg in pieces for a, b in seg)
    # Out of place, a received piece holds the running sum until it is sent on, one step
    # later: twice as many scratch slots as pieces in flight.
    slots = chunks if out is None else 2 * chunks
    scratch = src.new_empty(slots * largest)
    carry: dict[int, torch.Tensor] = {}  # item -> buffer holding the partial sum to send next
    items = [(k, c) for k in range(p - 1) for c in range(chunks)]

    def issue(idx: int) -> Pending:
        k, c = items[idx]
        a, b = pieces[(i - k - 1) % p][c]
        send = src[a:b] if (k == 0 or out is None) else carry.pop(idx - chunks)
        ra, rb = pieces[(i - k - 2) % p][c]
        slot = (idx % slots) * largest
        buf = scratch[slot:slot + rb - ra]
        carry[idx] = buf
        return exchange([(send, nxt)], [(buf, prev)], tag=tag + idx, what="ring reduce-scatter")

    def finish(idx: int) -> None:
        k, c = items[idx]
        ra, rb = pieces[(i - k - 2) % p][c]
        buf, mine = carry[idx], src[ra:rb]
        if out is None:
            reduce_into(mine, mine, buf, op)
            del carry[idx]
        elif k == p - 2:  # the last hop: this piece of my own segment is complete
            start = bounds[i][0]
            reduce_into(out[ra - start:rb - start], mine, buf, op)
            del carry[idx]
        else:
            reduce_into(buf, buf, mine, op)

    _pipeline(len(items), chunks, issue, finish)


def all_gather_phase(buf: torch.Tensor, ranks: Sequence[int], bounds: Sequence[tuple[int, int]],
                     chunks: int = 1, tag: int = 0) -> None:
    """The ring all-gather over `ranks` in place: buf[bounds[i]] of ranks[i] goes everywhere."""
    p, me = len(ranks), group.rank()
    if p == 1:
        return
    i = ranks.index(me)
    prev, nxt = ring_neighbours(ranks, me)
    pieces = _pieces(bounds, chunks)
    items = [(k, c) for k in range(p - 1) for c in range(chunks)]

    def issue(idx: int) -> Pending:
        k, c = items[idx]
        a, b = pieces[(i - k) % p][c]
        ra, rb = pieces[(i - k - 1) % p][c]
        return exchange([(buf[a:b], nxt)], [(buf[ra:rb], prev)], tag=tag + idx,
                        what="ring all-gather")

    _pipeline(len(items), chunks, issue, lambda idx: None)


def _check_chunks(chunks: int) -> None:
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive integer, got {chunks!r}")


def ring_all_reduce(tensor: torch.Tensor, op: str = "sum", *, chunks: int = 1) -> torch.Tensor:
    """Reduce `tensor` (any shape, any size) across all ranks, in place; returns it.

    op: "sum", "max" or "avg" (floating dtypes). Every rank ends with identical values.
    """
    check_op(op, tensor.dtype)
    _check_chunks(chunks)
    ranks, work = list(range(group.world_size())), flat(tensor)
    agree("ring_all_reduce", work, ring_neighbours(ranks, group.rank()), op=op,
          params=[("chunks", chunks)])
    bounds = segment_bounds(work.numel(), len(ranks))
    reduce_scatter_phase(work, op, ranks, bounds, chunks)
    if op == "avg":  # divide once, on the one segment this rank owns
        a, b = bounds[group.rank()]
        work[a:b].div_(len(ranks))
    all_gather_phase(work, ranks, bounds, chunks, tag=len(ranks) * chunks)
    return write_back(tensor, work)


def ring_all_gather(tensor: torch.Tensor, *, chunks: int = 1) -> torch.Tensor:
    """Every rank's `tensor` (same shape on all ranks), concatenated in rank order along dim 0.

    An input of shape (n, ...) gives (world*n, ...); a 0-d input gives (world,).
    """
    _check_chunks(chunks)
    p, me = group.world_size(), group.rank()
    work = flat(tensor)
    agree("ring_all_gather", work, ring_neighbours(list(range(p)), me), params=[("chunks", chunks)])
    n = work.numel()
    out = work.new_empty(p * n)
    out[me * n:(me + 1) * n] = work
    all_gather_phase(out, list(range(p)), [(r * n, (r + 1) * n) for r in range(p)], chunks)
    shape = (p * tensor.shape[0], *tensor.shape[1:]) if tensor.dim() else (p,)
    return out.view(shape)


def ring_reduce_scatter(tensor: torch.Tensor, op: str = "sum", *, chunks: int = 1) -> torch.Tensor:
    """Reduce `tensor` (any size) across ranks; rank r gets segment r, 1-D; the input is unchanged.

    Segments are those of torch.tensor_split(tensor.flatten(), world_size).
    """
    check_op(op, tensor.dtype)
    _check_chunks(chunks)
    p, me = group.world_size(), group.rank()
    work = flat(tensor)
    agree("ring_reduce_scatter", work, ring_neighbours(list(range(p)), me), op=op,
          params=[("chunks", chunks)])
    bounds = segment_bounds(work.numel(), p)
    out = work.new_empty(bounds[me][1] - bounds[me][0])
    reduce_scatter_phase(work, op, list(range(p)), bounds, chunks, out=out)
    if op == "avg":
        out.div_(p)
    return out
