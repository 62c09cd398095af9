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
(i-k) mod p (the one it received last step) and receives segment (i-k-1) mod p — straight
into its place in the output, so the gather copies nothing.
    bytes sent per rank: (p-1)/p * n     time: (p-1) alpha + (p-1)/p * n beta

All-reduce is both:  2(p-1) alpha + 2(p-1)/p * n beta.  The bandwidth term does not grow
with p: the ring is bandwidth-optimal, which is why NCCL uses it for large messages; the
latency term grows linearly, which is why small messages prefer a tree (tree.py).

Pipelining. Done naively, each step is "exchange, wait, add": the link idles while the
GPU adds and the adder idles while the link moves data. So each segment is cut into
`pieces` (tuning.py picks ~32 MiB pieces on GPUs), and the ring moves pieces: the work is a
list of items (step k, piece c), and item i needs only item i - pieces (the same piece one
step earlier) to be finished. Up to `pieces` items are in flight, so piece c+1 crosses the
link while piece c is added. The all-reduce runs both phases as one list: the all-gather
of piece c starts as soon as piece c of this rank's segment is fully reduced, without
waiting for the other pieces. Scratch is a few piece-sized buffers, reused in turn.
On NCCL the waiting is done by CUDA streams, not by the host: `Pending.wait()` makes the
compute stream wait for the transfer, and each new transfer waits for the compute stream,
so the host queues the whole schedule and the GPU runs it with the overlap built in.
(n above counts bytes; alpha is per-message latency, beta seconds per byte.)
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from . import group, tuning
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


@dataclass
class Stage:
    """One phase of a ring schedule as `count` items: issue(j, tag) posts item j's transfer,
    finish(j) uses what arrived (after the transfer is waited for)."""

    count: int
    issue: Callable[[int, int], Pending]
    finish: Callable[[int], None]


def run_pipeline(stages: Sequence[Stage], depth: int, tag: int = 0) -> None:
    """Run the stages' items in order, keeping at most `depth` of them in flight.

    Item i may depend on item i - depth, so that one is finished (waited for and used)
    before item i is issued. Items are numbered across stages, and so are their tags.
    """
    items = [(stage, j) for stage in stages for j in range(stage.count)]
    inflight: deque[tuple[int, Pending]] = deque()

    def retire() -> None:
        i, pending = inflight.popleft()
        pending.wait()
        stage, j = items[i]
        stage.finish(j)

    for i, (stage, j) in enumerate(items):
        while inflight and inflight[0][0] <= i - depth:
            retire()
        inflight.append((i, stage.issue(j, tag + i)))
    while inflight:
        retire()


def cut(bounds: Sequence[tuple[int, int]], pieces: int) -> list[list[tuple[int, int]]]:
    """Each segment's `pieces` sub-ranges, in absolute offsets."""
    return [[(a + s, a + e) for s, e in segment_bounds(b - a, pieces)] for a, b in bounds]


def reduce_scatter_stage(src: torch.Tensor, op: str, ranks: Sequence[int],
                         bounds: Sequence[tuple[int, int]], pieces: int,
                         out: torch.Tensor | None = None, divide: int = 1) -> Stage:
    """The ring reduce-scatter over `ranks` (global ranks, in ring order) of flat `src`.

    With out=None it works in place: afterwards src[bounds[i]] on ranks[i] holds the
    reduced segment (other segments hold partial sums). Otherwise `src` is only read and
    `out` (the size of my segment) receives the result. `divide` > 1 divides each finished
    piece of my segment ("avg"; the sum of the others is never divided).
    """
    p, me = len(ranks), group.rank()
    i = ranks.index(me)
    prev, nxt = ring_neighbours(ranks, me)
    parts = cut(bounds, pieces)
    largest = max(b - a for seg in parts for a, b in seg)
    # A received piece is added into src in place, so one slot per piece in flight. Out of
    # place the sum stays in its slot until it is sent on a step later: twice as many.
    slots = pieces if out is None else 2 * pieces
    scratch = src.new_empty(slots * largest)
    held: dict[int, torch.Tensor] = {}  # item -> the buffer it received into
    start = bounds[i][0]

    def issue(j: int, tag: int) -> Pending:
        k, c = divmod(j, pieces)
        a, b = parts[(i - k - 1) % p][c]
        send = src[a:b] if (k == 0 or out is None) else held.pop(j - pieces)
        ra, rb = parts[(i - k - 2) % p][c]
        slot = (j % slots) * largest
        held[j] = scratch[slot:slot + rb - ra]
        return exchange([(send, nxt)], [(held[j], prev)], tag=tag, what="ring reduce-scatter")

    def finish(j: int) -> None:
        k, c = divmod(j, pieces)
        ra, rb = parts[(i - k - 2) % p][c]
        got, mine = held[j], src[ra:rb]
        last = k == p - 2  # this piece of my own segment is now complete
        if out is None:
            reduce_into(mine, mine, got, op)
            del held[j]
            if last and divide > 1:
                mine.div_(divide)
        elif last:
            reduce_into(out[ra - start:rb - start], mine, got, op)
            del held[j]
            if divide > 1:
                out[ra - start:rb - start].div_(divide)
        else:  # keep the partial sum in its slot; the next step sends it on
            reduce_into(got, got, mine, op)

    return Stage((p - 1) * pieces, issue, finish)


def all_gather_stage(buf: torch.Tensor, ranks: Sequence[int], bounds: Sequence[tuple[int, int]],
                     pieces: int, mine: torch.Tensor | None = None) -> Stage:
    """The ring all-gather over `ranks` into flat `buf`: buf[bounds[i]] of ranks[i] goes everywhere.

    With `mine` given, this rank's segment is sent from `mine` and copied into `buf` while
    the first transfer runs (ring_all_gather: the input is not inside the output).
    """
    p, me = len(ranks), group.rank()
    i = ranks.index(me)
    prev, nxt = ring_neighbours(ranks, me)
    parts = cut(bounds, pieces)
    start = bounds[i][0]

    def issue(j: int, tag: int) -> Pending:
        k, c = divmod(j, pieces)
        a, b = parts[(i - k) % p][c]
        ra, rb = parts[(i - k - 1) % p][c]
        send = buf[a:b] if (k > 0 or mine is None) else mine[a - start:b - start]
        pending = exchange([(send, nxt)], [(buf[ra:rb], prev)], tag=tag, what="ring all-gather")
        if j == 0 and mine is not None:  # queued after the transfer, so the two overlap
            buf[bounds[i][0]:bounds[i][1]].copy_(mine)
        return pending

    return Stage((p - 1) * pieces, issue, lambda j: None)


def _pieces(chunks: int | None, segment_elements: int, dtype: torch.dtype) -> int:
    """`chunks` if given, else what tuning.py picks for a segment of this many bytes."""
    if chunks is None:
        return tuning.current().pieces(segment_elements * dtype.itemsize)
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ValueError(f"chunks must be a positive integer or None, got {chunks!r}")
    return chunks


def ring_all_reduce(
    tensor: torch.Tensor, op: str = "sum", *, chunks: int | None = None
) -> torch.Tensor:
    """Reduce `tensor` (any shape, any size) across all ranks, in place; returns it.

    op: "sum", "max" or "avg" (floating dtypes). Every rank ends with identical values.
    chunks: pipeline pieces per segment (None: chosen from the size, see tuning.py).
    """
    check_op(op, tensor.dtype)
    ranks, work = list(range(group.world_size())), flat(tensor)
    p = len(ranks)
    pieces = _pieces(chunks, -(-work.numel() // p), work.dtype)
    agree("ring_all_reduce", work, ring_neighbours(ranks, group.rank()), op=op,
          params=[("chunks", pieces)])
    if p > 1:
        bounds = segment_bounds(work.numel(), p)
        summed = "sum" if op == "avg" else op
        run_pipeline([reduce_scatter_stage(work, summed, ranks, bounds, pieces,
                                           divide=p if op == "avg" else 1),
                      all_gather_stage(work, ranks, bounds, pieces)], depth=pieces)
    return write_back(tensor, work)


def ring_all_gather(tensor: torch.Tensor, *, chunks: int | None = None) -> torch.Tensor:
    """Every rank's `tensor` (same shape on all ranks), concatenated in rank order along dim 0.

    An input of shape (n, ...) gives (world*n, ...); a 0-d input gives (world,).
    """
    p, me = group.world_size(), group.rank()
    work = flat(tensor)
    pieces = _pieces(chunks, work.numel(), work.dtype)
    agree("ring_all_gather", work, ring_neighbours(list(range(p)), me), params=[("chunks", pieces)])
    n = work.numel()
    out = work.new_empty(p * n)
    if p == 1:
        out.copy_(work)
    else:
        stage = all_gather_stage(out, list(range(p)), [(r * n, (r + 1) * n) for r in range(p)],
                                 pieces, mine=work)
        run_pipeline([stage], depth=pieces)
    shape = (p * tensor.shape[0], *tensor.shape[1:]) if tensor.dim() else (p,)
    return out.view(shape)


def ring_reduce_scatter(
    tensor: torch.Tensor, op: str = "sum", *, chunks: int | None = None
) -> torch.Tensor:
    """Reduce `tensor` (any size) across ranks; rank r gets segment r, 1-D; the input is unchanged.

    Segments are those of torch.tensor_split(tensor.flatten(), world_size).
    """
    check_op(op, tensor.dtype)
    p, me = group.world_size(), group.rank()
    work = flat(tensor)
    pieces = _pieces(chunks, -(-work.numel() // p), work.dtype)
    agree("ring_reduce_scatter", work, ring_neighbours(list(range(p)), me), op=op,
          params=[("chunks", pieces)])
    bounds = segment_bounds(work.numel(), p)
    out = work.new_empty(bounds[me][1] - bounds[me][0])
    if p == 1:  # a world of one: the sum, max and average of one tensor are itself
        out.copy_(work)
    else:
        summed = "sum" if op == "avg" else op
        run_pipeline([reduce_scatter_stage(work, summed, list(range(p)), bounds, pieces, out=out,
                                           divide=p if op == "avg" else 1)], depth=pieces)
    return out
