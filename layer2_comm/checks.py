"""`stack run --layer 2`'s check: every collective of this layer against torch.distributed's
built-in, exactly, on integer-valued data (sums are exact), and both timed.

`check_rank(numel, iters)` runs on each rank of a group (launch() or torchrun) and returns one
row per case: {"collective", "detail", "ok" (on every rank), "ours_s", "torch_s"}.
"""
from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from .all_to_all import all_to_all
from .bench_bandwidth import time_collective
from .chain import broadcast_chain
from .group import device
from .hierarchical import hierarchical_all_reduce
from .ring import ring_all_gather, ring_all_reduce, ring_reduce_scatter
from .tree import broadcast_tree, tree_all_reduce

# torch 2.x renamed the gather-into-one-tensor collective; either does here.
_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _splits(src: int, world: int) -> list[int]:
    """Uneven all-to-all split sizes rank ``src`` sends to each rank (some are 0)."""
    return [(3 * src + 5 * dst) % 4 for dst in range(world)]


def cases(x: torch.Tensor, world: int, me: int) -> list[tuple]:
    """(name, detail, ours(), built-in()) on fresh copies of this rank's input ``x``."""
    n, rpn = x.numel(), 2 if world % 2 == 0 else 1
    mine = _splits(me, world)
    a2a_in = x[: sum(mine)].clone()

    def ref_reduce(op=dist.ReduceOp.SUM):
        y = x.clone()
        dist.all_reduce(y, op=op)
        return y

    def ref_gather():
        out = x.new_empty(n * world)
        _gather(out, x.clone())
        return out

    def ref_broadcast(src):
        y = x.clone()
        dist.broadcast(y, src)
        return y

    def ref_a2a():
        out = x.new_empty(sum(_splits(s, world)[me] for s in range(world)))
        incoming = [_splits(s, world)[me] for s in range(world)]
        dist.all_to_all_single(out, a2a_in.clone(), incoming, mine)
        return out

    return [
        ("ring_all_reduce", "sum", lambda: ring_all_reduce(x.clone()), ref_reduce),
        ("ring_all_reduce", "max int64", lambda: ring_all_reduce(x.long(), "max"),
         lambda: ref_reduce(dist.ReduceOp.MAX).long()),
        ("ring_all_reduce", "avg", lambda: ring_all_reduce(x.clone(), "avg"),
         lambda: ref_reduce() / world),
        ("ring_all_reduce", "sum chunks=4", lambda: ring_all_reduce(x.clone(), chunks=4),
         ref_reduce),
        ("tree_all_reduce", "sum", lambda: tree_all_reduce(x.clone()), ref_reduce),
        ("hierarchical_all_reduce", f"sum {rpn}/node",
         lambda: hierarchical_all_reduce(x.clone(), rpn), ref_reduce),
        ("ring_all_gather", "", lambda: ring_all_gather(x.clone()), ref_gather),
        ("ring_reduce_scatter", "sum uneven", lambda: ring_reduce_scatter(x.clone()),
         lambda: torch.tensor_split(ref_reduce(), world)[me]),
        ("broadcast_tree", f"src={world - 1}", lambda: broadcast_tree(x.clone(), world - 1),
         lambda: ref_broadcast(world - 1)),
        ("broadcast_chain", "src=0 chunks=4", lambda: broadcast_chain(x.clone(), 0),
         lambda: ref_broadcast(0)),
        ("all_to_all", f"splits {mine}", lambda: all_to_all(a2a_in.clone(), mine), ref_a2a),
    ]


def check_rank(numel: int, iters: int) -> list[dict]:
    """Each case once for the check, then ``iters`` timed runs of ours and of the built-in."""
    world, me, dev = dist.get_world_size(), dist.get_rank(), device()
    gen = torch.Generator().manual_seed(1234 + me)
    x = torch.randint(-50, 50, (numel,), generator=gen).float().to(dev)  # exact sums
    rows = []
    for name, detail, ours, ref in cases(x, world, me):
        got, want = ours(), ref()
        exact = got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
        close = got.shape == want.shape and torch.allclose(got.double(), want.double())
        ok = exact or (detail == "avg" and close)  # avg may divide before or after summing
        flag = torch.tensor([int(ok)], device=dev)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        rows.append({"collective": name, "detail": detail, "ok": bool(flag.item()),
                     "ours_s": statistics.median(time_collective(ours, iters, 2, dev)),
                     "torch_s": statistics.median(time_collective(ref, iters, 2, dev))})
    return rows
