"""Logarithmic collectives: recursive-doubling all-reduce and binomial-tree broadcast/reduce.

Recursive doubling (all-reduce), for p a power of two: log2(p) steps. At step s rank i
swaps its whole tensor with rank i XOR 2^s and both combine the two. After step s each
rank holds the reduction over a block of 2^(s+1) ranks; after log2(p) steps, over all.
    bytes sent per rank: log2(p) * n     time: log2(p) alpha + log2(p) * n beta
Fewer steps than the ring's 2(p-1) — better for small, latency-bound messages — but every
step moves the whole tensor, so for large ones the ring's 2(p-1)/p * n beta wins.
Both partners compute a+b (or max) of the same two tensors, and IEEE addition is
commutative, so every rank ends with bit-identical values.

Other p: let q be the largest power of two <= p and r = p - q. Pre-step: each of the first
r even ranks sends its tensor to the odd rank after it and sits out; the q remaining ranks
run recursive doubling; post-step: each odd rank sends the result back to its even partner.
    time: (log2(q) + 2) alpha + (log2(q) + 2) * n beta

Binomial-tree broadcast: in round s every rank that already has the data sends it to the
rank 2^s further along (counted from the root), so the informed set doubles each round.
    log2(p) rounds; the root sends log2(p) * n bytes; time: ceil(log2 p) (alpha + n beta)
The binomial reduce is the same tree run backwards, combining on the way up.
(n counts bytes; alpha is per-message latency, beta seconds per byte.)
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from . import group
from .p2p import agree, check_op, exchange, flat, reduce_into, write_back


def _core_rank(i: int, extra: int) -> int | None:
    """Index among the power-of-two core of position i, or None if i sits out."""
    if i < 2 * extra:
        return i // 2 if i % 2 else None
    return i - extra


def _from_core(j: int, extra: int) -> int:
    return 2 * j + 1 if j < extra else j + extra


def doubling_peers(p: int, i: int) -> list[int]:
    """Positions that position i talks to in recursive doubling (pre/post partner included)."""
    q = 1 << (p.bit_length() - 1)
    extra = p - q
    j = _core_rank(i, extra)
    if j is None:
        return [i + 1]
    peers = [i - 1] if i < 2 * extra else []
    mask = 1
    while mask < q:
        peers.append(_from_core(j ^ mask, extra))
        mask <<= 1
    return peers


def recursive_doubling(work: torch.Tensor, op: str, ranks: Sequence[int]) -> None:
    """All-reduce flat `work` in place over `ranks` by recursive doubling ("avg" only sums)."""
    p, i = len(ranks), ranks.index(group.rank())
    q = 1 << (p.bit_length() - 1)
    extra = p - q
    j = _core_rank(i, extra)
    if j is None:  # pre-step: hand my data to my odd partner, then wait for the answer
        exchange([(work, ranks[i + 1])], [], tag=0, what="recursive doubling (pre)").wait()
        exchange([], [(work, ranks[i + 1])], tag=1, what="recursive doubling (post)").wait()
        return
    scratch = torch.empty_like(work)
    if i < 2 * extra:
        exchange([], [(scratch, ranks[i - 1])], tag=0, what="recursive doubling (pre)").wait()
        reduce_into(work, work, scratch, op)
    mask, step = 1, 2
    while mask < q:
        partner = ranks[_from_core(j ^ mask, extra)]
        exchange([(work, partner)], [(scratch, partner)], tag=step,
                 what="recursive doubling").wait()
        reduce_into(work, work, scratch, op)
        mask, step = mask << 1, step + 1
    if i < 2 * extra:
        exchange([(work, ranks[i - 1])], [], tag=1, what="recursive doubling (post)").wait()


def tree_all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Reduce `tensor` (any shape and size) across all ranks in place by recursive doubling."""
    check_op(op, tensor.dtype)
    p, me = group.world_size(), group.rank()
    work = flat(tensor)
    agree("tree_all_reduce", work, doubling_peers(p, me), op=op)
    recursive_doubling(work, op, list(range(p)))
    if op == "avg":
        work.div_(p)
    return write_back(tensor, work)


def binomial_peers(p: int, i: int, root: int) -> tuple[int | None, list[int]]:
    """(parent, children) of position i in the binomial tree over p positions rooted at root."""
    v = (i - root) % p
    parent, mask = None, 1
    while mask < p:
        if v & mask:
            parent = (v - mask + root) % p
            break
        mask <<= 1
    children = []
    mask >>= 1
    while mask > 0:  # children get the largest subtrees first
        if v + mask < p:
            children.append((v + mask + root) % p)
        mask >>= 1
    return parent, children


def binomial_broadcast(work: torch.Tensor, ranks: Sequence[int], root: int) -> None:
    """Broadcast flat `work` in place from ranks[root] down the binomial tree over `ranks`."""
    parent, children = binomial_peers(len(ranks), ranks.index(group.rank()), root)
    if parent is not None:
        exchange([], [(work, ranks[parent])], what="binomial broadcast").wait()
    # All children at once: the sends overlap instead of queueing behind each other.
    exchange([(work, ranks[c]) for c in children], [], what="binomial broadcast").wait()


def binomial_reduce(work: torch.Tensor, op: str, ranks: Sequence[int], root: int) -> None:
    """Reduce flat `work` onto ranks[root] up the binomial tree (others keep partial results)."""
    parent, children = binomial_peers(len(ranks), ranks.index(group.rank()), root)
    scratch = torch.empty_like(work) if children else work
    for child in reversed(children):  # smallest subtree first: it is ready soonest
        exchange([], [(scratch, ranks[child])], what="binomial reduce").wait()
        reduce_into(work, work, scratch, op)
    if parent is not None:
        exchange([(work, ranks[parent])], [], what="binomial reduce").wait()


def broadcast_tree(tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Copy rank `src`'s `tensor` into every rank's `tensor` (same shape), in place."""
    p, me = group.world_size(), group.rank()
    if not 0 <= src < p:
        raise ValueError(f"src must be a rank in 0..{p - 1}, got {src}")
    work = flat(tensor)
    parent, children = binomial_peers(p, me, src)
    agree("broadcast_tree", work, ([] if parent is None else [parent]) + children,
          params=[("src", src)])
    binomial_broadcast(work, list(range(p)), src)
    return write_back(tensor, work)
