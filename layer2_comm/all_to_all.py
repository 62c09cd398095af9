"""All-to-all with uneven splits: rank i sends rows send_splits[j] of its tensor to rank j.

This is the exchange behind expert parallelism (tokens routed to the rank holding their
expert) and sequence/head re-sharding: every rank has something different for every
other rank, and the amounts differ.

1. Sizes: the receiver cannot size its buffers alone, so each pair first swaps a small
   header (how many rows, dtype, row length) — one latency, which also catches ranks
   that disagree on dtype or row shape.
2. Data, pairwise exchange in p-1 steps: at step s rank i sends its block for rank i+s and
   receives from rank i-s (mod p). Every rank sends to and receives from exactly one peer
   per step, so no rank is swamped by p-1 senders at once. Its own block is a local copy.
    bytes sent per rank: the rows it sends to others     time: (p-1) alpha + max_s(bytes) beta
(for even splits, (p-1) alpha + (p-1)/p * n beta, as for the ring all-gather.)
"""
from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import torch

from . import group
from .p2p import DTYPES, KINDS, check_device, dtype_code, exchange, exchange_headers
from .tuning import current as current_tuning


def all_to_all(tensor: torch.Tensor, send_splits: Sequence[int]) -> torch.Tensor:
    """Send tensor[rows of split j] to rank j; return what each rank sent me, in rank order.

    `tensor` has shape (rows, ...) with rows == sum(send_splits); len(send_splits) ==
    world_size. The result has shape (sum of what the others send me, ...), concatenated
    along dim 0 by source rank.
    """
    p, me = group.world_size(), group.rank()
    if tensor.dim() == 0:
        raise ValueError("all_to_all needs a tensor with at least one dimension (rows to split)")
    splits = [int(s) for s in send_splits]
    if len(splits) != p or any(s < 0 for s in splits) or sum(splits) != tensor.shape[0]:
        raise ValueError(f"send_splits must be {p} non-negative row counts summing to "
                         f"tensor.shape[0]={tensor.shape[0]}, got {list(send_splits)}")
    check_device("all_to_all", tensor)
    rest = tuple(tensor.shape[1:])
    row = 1
    for d in rest:
        row *= d
    # Header: (collective, rows for you, dtype, row length, ndim, lanes). The receiver learns
    # its sizes from field 1 and checks the rest. Unlike the other collectives' header this
    # one is needed even with checks off: it carries the sizes.
    kind, lanes = KINDS.index("all_to_all"), current_tuning().lanes
    mine = [kind, 0, dtype_code(tensor.dtype), row, tensor.dim(), lanes, 0]  # the header's size
    theirs = exchange_headers({j: mine[:1] + [splits[j]] + mine[2:] for j in range(p) if j != me},
                              what="all_to_all")
    for j, h in theirs.items():
        if h[0] != kind or h[2:] != mine[2:]:
            dt = DTYPES[h[2]] if 0 <= h[2] < len(DTYPES) else "an unsupported dtype"
            raise ValueError(f"all_to_all: rank {me} sends rows of {row} elements of "
                             f"{tensor.dtype} ({tensor.dim()}-d), but rank {j} sends rows of "
                             f"{h[3]} elements of {dt} ({h[4]}-d)"
                             + ("" if h[0] == kind else f" from a different collective (#{h[0]})")
                             + ("" if h[5] == lanes
                                else f" (lanes {lanes} vs {h[5]}: tuning differs)"))
    group.lane_groups(lanes)  # every rank passes here: make the lane groups on first use
    recv_splits = [splits[me] if j == me else theirs[j][1] for j in range(p)]

    src = tensor.contiguous()
    out = src.new_empty((sum(recv_splits), *rest))
    send_at = list(accumulate(splits, initial=0))  # row offsets of each peer's block
    recv_at = list(accumulate(recv_splits, initial=0))
    out[recv_at[me]:recv_at[me + 1]] = src[send_at[me]:send_at[me + 1]]
    for step in range(1, p):
        to, frm = (me + step) % p, (me - step) % p
        exchange([(src[send_at[to]:send_at[to + 1]], to)],
                 [(out[recv_at[frm]:recv_at[frm + 1]], frm)],
                 tag=step, what="all_to_all").wait()
    return out
