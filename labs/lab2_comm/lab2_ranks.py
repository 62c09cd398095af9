"""Programs that lab2.ipynb runs on every rank (read, no need to edit).

`layer2_comm.launch(fn, p, *args)` starts p fresh Python processes, and each one has to
import `fn` by name: a function defined in a notebook cell cannot travel to them, so the
notebook's rank programs live in this file. Each takes `impl`, the name of the module whose
collectives to run — "exercises" (your work) or "layer2_comm" (the reference) — and imports
it inside the rank. `run` (called in the notebook's own process) launches one of them.
"""
from __future__ import annotations

import importlib
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

import layer2_comm as l2


# ---------------------------------------------------------------- in the notebook's process
def run(fn: Callable, world: int, *args, timeout_s: float = 60.0) -> list:
    """launch(fn, world, *args) on gloo ranks; returns each rank's result. If a rank fails,
    raise a RuntimeError that shows the first failure (not every rank's traceback)."""
    try:
        return l2.launch(fn, world, *args, backend="gloo", timeout_s=timeout_s)
    except RuntimeError as exc:
        text = str(exc)
    lines = text.splitlines()
    heads = [i for i, line in enumerate(lines) if line.startswith("rank")] + [len(lines)]
    block = lines[heads[0]:heads[1]] if len(heads) > 1 else lines[1:]
    others = [lines[i][:160] for i in heads[1:-1]]
    raise RuntimeError("\n".join([lines[0], *block[:1], *block[1:][-12:], *others])) from None


# ---------------------------------------------------------------- on every rank
def _impl(name: str):
    return importlib.import_module(name)


def pass_right() -> dict:
    """Each rank sends a number to its right-hand neighbour and receives one from its left,
    posting the send and the receive together."""
    me, p = dist.get_rank(), dist.get_world_size()
    right, left = (me + 1) % p, (me - 1) % p
    mine = torch.tensor([100 + me])
    got = torch.empty(1, dtype=torch.int64)
    requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, right),
                                       dist.P2POp(dist.irecv, got, left)])
    for request in requests:
        request.wait()
    return {"rank": me, "sent": int(mine), "to": right, "received": int(got), "from": left}


def blocking_sends_face_each_other() -> None:
    """Ranks 0 and 1 both call dist.send before dist.recv: each waits for the other forever."""
    me = dist.get_rank()
    x = torch.ones(4)
    dist.send(x, 1 - me)  # returns once the peer has received... which it never does
    dist.recv(x, 1 - me)


@contextmanager
def count_sends() -> Iterator[dict[int, int]]:
    """Bytes this rank hands to the transport while the block runs, per destination rank.
    Every send (send, isend, batch_isend_irecv) ends in ProcessGroup.send: wrap it."""
    from torch._C._distributed_c10d import ProcessGroup

    sent: dict[int, int] = {}
    descriptor = ProcessGroup.__dict__["send"]
    original = ProcessGroup.send

    def counting(self, tensors, dst, *args, **kwargs):
        sent[int(dst)] = sent.get(int(dst), 0) + sum(t.numel() * t.element_size() for t in tensors)
        return original(self, tensors, dst, *args, **kwargs)

    ProcessGroup.send = counting
    try:
        yield sent
    finally:
        ProcessGroup.send = descriptor


def check(impl: str, name: str, seed: int = 0) -> dict:
    """Run impl.<name> ("ring_all_reduce" or "ring_all_gather") at several sizes and dtypes
    against torch.distributed's built-in; raise at the first difference. Returns the cases
    checked and, for the largest one, the bytes this rank sent to each peer."""
    torch.set_num_threads(1)
    fn = getattr(_impl(impl), name)
    me, p = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(seed * 1000 + me)
    cases, traffic = [], {}
    for n in sorted({0, 1, p - 1, 1000, 1003}):
        for dtype, op in ((torch.float32, "sum"), (torch.int64, "max")):
            x = (torch.randn(n, generator=g) if dtype.is_floating_point
                 else torch.randint(-99, 99, (n,), generator=g))
            if name == "ring_all_reduce":
                want = x.clone()
                dist.all_reduce(want, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
                with count_sends() as sent:
                    got = fn(x, op=op)
                ok = torch.allclose(got, want, rtol=1e-5, atol=1e-5) and torch.equal(x, got)
                label = f"n={n} {str(dtype)[6:]} op={op}"
            else:
                parts = [torch.empty_like(x) for _ in range(p)]
                dist.all_gather(parts, x)
                want = torch.cat(parts)
                with count_sends() as sent:
                    got = fn(x)
                ok = got.shape == want.shape and torch.equal(got, want)
                label = f"n={n} {str(dtype)[6:]}"
            if not ok:
                raise AssertionError(f"rank {me}: {name} differs from torch.distributed for {label}")
            cases.append(label)
            if n == 1003 and dtype == torch.float32:
                traffic = {"tensor_bytes": (want if name == "ring_all_gather" else x).numel() * 4,
                           "sent": dict(sent)}
    return {"rank": me, "cases": cases, **traffic}


def _median_time(fn: Callable[[], object], iters: int, warmup: int) -> float:
    """Median over iterations of the slowest rank's time; every iteration starts together."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        dist.barrier()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    t = torch.tensor(samples, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a collective is done when its slowest rank is
    return statistics.median(t.tolist())


def measure(impl: str, sizes: list[int], iters: int = 5, warmup: int = 1,
            ping_sizes: list[int] | None = None) -> dict | None:
    """Time all-reduce at each size in bytes (float32): your ring (impl.ring_all_reduce),
    layer2_comm's recursive-doubling tree, and gloo's own. With ping_sizes, also a ping-pong
    between ranks 0 and 1 (one-way seconds per size). Rank 0 returns the rows, others None."""
    torch.set_num_threads(1)  # the ranks share this machine's cores
    ring = _impl(impl).ring_all_reduce
    algorithms = {"ring (exercise 1)": ring, "tree (layer2_comm)": l2.tree_all_reduce,
                  "gloo built-in": dist.all_reduce}
    rows = []
    for nbytes in sizes:
        x = torch.zeros(max(1, nbytes // 4))  # zeros: repeated sums stay finite
        for label, fn in algorithms.items():
            t = _median_time(lambda fn=fn, x=x: fn(x), iters, warmup)
            rows.append({"algorithm": label, "bytes": x.numel() * 4, "time_s": t,
                         "world": dist.get_world_size()})
    out = {"rows": rows}
    if ping_sizes:
        out["ping_pong"] = l2.ping_pong(ping_sizes, iters=iters + 5, warmup=warmup + 1)
    return out if dist.get_rank() == 0 else None
