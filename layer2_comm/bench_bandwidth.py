"""An nccl-tests-style bandwidth sweep, run inside every rank of a process group.

For each message size the collective runs ``warmup`` times, then ``iters`` timed times:
on CUDA back to back between CUDA events on the current stream (the GPU timestamps
them, so host skew between ranks only touches the first call); on gloo each call starts
after a barrier and is timed with ``perf_counter``. A collective is done when its slowest
rank is, so each iteration's time is the maximum over ranks; we report the median.

    algbw = bytes / time                  (what the caller sees)
    busbw = algbw x factor                (what each link carried; cost_model.busbw)

``bytes`` is nccl-tests' size: the reduced tensor, the gathered output, the scattered
input, each rank's whole all-to-all send buffer. ``ours=True`` times this package's
send/recv collectives, ``ours=False`` torch.distributed's built-in on the same buffers.
Every size is first checked once, on integer-valued data, against the exact answer.
Above 256 MiB each call takes milliseconds and the median settles quickly, so the number
of timed runs shrinks with the size (``iters_at``), which keeps a sweep to 1 GiB short.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from layer1_kernels import hardware

from . import tuning
from .all_to_all import all_to_all
from .chain import broadcast_chain
from .cost_model import busbw, collective_of
from .group import barrier, device
from .hierarchical import hierarchical_all_reduce
from .overlap import overlap_on_rank
from .ring import ring_all_gather, ring_all_reduce, ring_reduce_scatter
from .tree import broadcast_tree, tree_all_reduce

# torch 2.13 renamed the tensor-in/tensor-out collectives; the GPU machine runs 2.11.
_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

OURS: dict[str, Callable] = {  # algorithm -> how our implementation is called on the buffers
    "ring_all_reduce": lambda b, kw: ring_all_reduce(b["x"]),
    "tree_all_reduce": lambda b, kw: tree_all_reduce(b["x"]),
    "hierarchical_all_reduce": lambda b, kw: hierarchical_all_reduce(b["x"], kw["ranks_per_node"]),
    "ring_all_gather": lambda b, kw: ring_all_gather(b["x"]),
    "ring_reduce_scatter": lambda b, kw: ring_reduce_scatter(b["x"]),
    "broadcast_tree": lambda b, kw: broadcast_tree(b["x"], 0),
    "broadcast_chain": lambda b, kw: broadcast_chain(b["x"], 0),
    "all_to_all": lambda b, kw: all_to_all(
        b["x"], [b["x"].numel() // dist.get_world_size()] * dist.get_world_size()
    ),
}
BUILT_IN: dict[str, Callable] = {  # collective -> torch.distributed's call on the same buffers
    "all_reduce": lambda b: dist.all_reduce(b["x"]),
    "all_gather": lambda b: _gather_single(b["out"], b["x"]),
    "reduce_scatter": lambda b: _scatter_single(b["out"], b["x"]),
    "broadcast": lambda b: dist.broadcast(b["x"], 0),
    "all_to_all": lambda b: dist.all_to_all_single(b["out"], b["x"]),
}
DEFAULT_ALGORITHM = {"all_reduce": "ring_all_reduce", "all_gather": "ring_all_gather",
                     "reduce_scatter": "ring_reduce_scatter", "broadcast": "broadcast_tree",
                     "all_to_all": "all_to_all"}


def default_sizes(max_bytes: int, min_bytes: int = 8, factor: int = 2) -> list[int]:
    """Message sizes ``min_bytes, min_bytes*factor, ...`` up to ``max_bytes`` inclusive."""
    if min_bytes < 1 or max_bytes < min_bytes or factor < 2:
        raise ValueError(f"need 1 <= min_bytes <= max_bytes and factor >= 2, got "
                         f"{min_bytes}, {max_bytes}, {factor}")
    sizes = [min_bytes]
    while sizes[-1] * factor <= max_bytes:
        sizes.append(sizes[-1] * factor)
    return sizes


def _buffers(kind: str, count: int, world: int, me: int, dev, dtype) -> tuple[dict, torch.Tensor]:
    """Inputs for one rank, filled with small integers, and the exact expected output."""
    i = torch.arange(count, device=dev, dtype=torch.int32) % 7
    if kind == "all_reduce":
        x = (i + me).to(dtype)
        return {"x": x}, (i * world + world * (world - 1) // 2).to(dtype)
    if kind == "broadcast":
        return {"x": ((i + 1) if me == 0 else torch.zeros_like(i)).to(dtype)}, (i + 1).to(dtype)
    chunk = count // world
    if kind == "all_gather":
        x = (i[:chunk] + me).to(dtype)
        expected = torch.cat([i[:chunk] + r for r in range(world)])
        return {"x": x, "out": torch.empty(count, device=dev, dtype=dtype)}, expected.to(dtype)
    if kind == "reduce_scatter":
        x = (i + me).to(dtype)
        reduced = i * world + world * (world - 1) // 2
        expected = reduced[me * chunk:(me + 1) * chunk].to(dtype)
        return {"x": x, "out": torch.empty(chunk, device=dev, dtype=dtype)}, expected
    # all_to_all: the piece rank s sends to rank d holds s * world + d
    x = (torch.arange(count, device=dev) // chunk + me * world).to(dtype)
    expected = (torch.arange(count, device=dev) // chunk * world + me).to(dtype)
    return {"x": x, "out": torch.empty(count, device=dev, dtype=dtype)}, expected


LARGE_BYTES = 256 << 20  # from here up, fewer timed runs


def iters_at(nbytes: int, iters: int, warmup: int) -> tuple[int, int]:
    """(timed runs, warm-up runs) for one size: as asked up to LARGE_BYTES, then fewer in
    proportion to the size (at least 5 timed, or ``iters`` if that is smaller)."""
    if nbytes <= LARGE_BYTES:
        return iters, warmup
    return max(min(iters, 5), iters * LARGE_BYTES // nbytes), min(warmup, 2)


def time_collective(fn: Callable[[], object], iters: int, warmup: int, dev) -> list[float]:
    """Per-iteration seconds of ``fn`` (a collective; call on every rank), each the
    maximum over ranks, identical on every rank."""
    if dev.type == "cuda":
        barrier(dev)
        samples = hardware.time_fn(fn, warmup=warmup, repeats=iters, device=dev).samples
    else:
        for _ in range(warmup):
            fn()
        samples = []
        for _ in range(iters):
            barrier(dev)  # everyone starts together, so the time is the collective's
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
    t = torch.tensor(samples, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def sweep(collective: str, sizes: Sequence[int], *, ours: bool, iters: int = 20, warmup: int = 5,
          dtype: torch.dtype = torch.float32, ranks_per_node: int | None = None) -> list[dict]:
    """Time ``collective`` at each size in bytes; one row per size, the same on every rank.

    ``collective``: a collective ("all_reduce", "all_gather", "reduce_scatter",
    "broadcast", "all_to_all") or one of our algorithms ("tree_all_reduce",
    "broadcast_chain", "hierarchical_all_reduce" with ``ranks_per_node``, ...). With
    ``ours=False`` the built-in of the same collective is timed. Call it on every rank.
    """
    if not dist.is_initialized():
        raise RuntimeError("sweep runs inside a process group: call it "
                           "from launch(...) or torchrun")
    if iters < 1 or warmup < 0:
        raise ValueError(f"need iters >= 1 and warmup >= 0, got {iters}, {warmup}")
    algorithm = DEFAULT_ALGORITHM.get(collective, collective)
    if algorithm not in OURS:
        raise ValueError(f"unknown collective {collective!r}; known: "
                         f"{', '.join([*DEFAULT_ALGORITHM, *OURS])}")
    if algorithm == "hierarchical_all_reduce" and not ranks_per_node:
        raise ValueError("hierarchical_all_reduce needs ranks_per_node")
    kind = collective_of(algorithm)
    world, me, dev = dist.get_world_size(), dist.get_rank(), device()
    elsize = torch.empty(0, dtype=dtype).element_size()
    rows = []
    for nbytes in sizes:
        count = max(1, int(nbytes) // elsize)
        if kind in ("all_gather", "reduce_scatter", "all_to_all"):
            count = max(1, count // world) * world  # equal pieces, as nccl-tests sizes them
        buffers, expected = _buffers(kind, count, world, me, dev, dtype)
        if ours:
            def call(b=buffers):
                return OURS[algorithm](b, {"ranks_per_node": ranks_per_node})
        else:
            def call(b=buffers):
                BUILT_IN[kind](b)
                return b.get("out", b["x"])
        ok = bool(torch.equal(call(), expected))
        ok = _all_ranks_agree(ok, dev)
        real_bytes = count * elsize
        median = statistics.median(time_collective(call, *iters_at(real_bytes, iters, warmup), dev))
        algbw = real_bytes / median if median > 0 else float("inf")
        rows.append({
            "collective": kind, "algorithm": algorithm if ours else f"torch.{kind}",
            "impl": "ours" if ours else "torch", "bytes": real_bytes, "count": count,
            "dtype": str(dtype).removeprefix("torch."), "world": world,
            "backend": dist.get_backend(), "time_s": median, "algbw": algbw,
            "busbw": busbw(algbw, kind, world), "ok": ok,
        })
    return rows


def _all_ranks_agree(ok: bool, dev) -> bool:
    flag = torch.tensor([0 if ok else 1], device=dev)
    dist.all_reduce(flag)  # any rank's failure fails the row on every rank
    return int(flag.item()) == 0


def ping_pong(sizes: Sequence[int], *, iters: int = 20, warmup: int = 5) -> list[dict]:
    """One-way point-to-point time between ranks 0 and 1 at each size (for fit_alpha_beta).

    Rank 0 sends ``n`` bytes to rank 1, which sends them back; one-way = round trip / 2.
    Other ranks wait. Returns the same rows on every rank: ``{"bytes", "time_s"}``.
    """
    if dist.get_world_size() < 2:
        raise RuntimeError("ping_pong needs at least 2 ranks")
    me, dev = dist.get_rank(), device()
    rows = []
    for nbytes in sizes:
        buf = torch.zeros(max(1, int(nbytes)), dtype=torch.uint8, device=dev)

        def round_trip(buf=buf) -> None:
            if me == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif me == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)

        t = statistics.median(
            time_collective(round_trip, *iters_at(buf.numel(), iters, warmup), dev)
        )
        rows.append({"bytes": buf.numel(), "time_s": t / 2})
    return rows


BENCH_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


def bench_rank(
    sizes: list[int], iters: int, warmup: int, overlap: dict | None = None
) -> dict | None:
    """`stack bench`'s work on each rank: ours and built-in for BENCH_COLLECTIVES, our
    tree all-reduce, a ping-pong and, given ``overlap`` (overlap_on_rank's keyword
    arguments), the overlap measurement. Rank 0 returns {"rows", "ping_pong", "overlap"},
    others None."""
    rows = []
    # Ours run without the header check (tuning's debug switch; the tests keep it on): every
    # rank here passes the same sizes, and the check's host round trip is not the collective.
    with tuning.override(check=False):
        for collective in BENCH_COLLECTIVES:
            rows += sweep(collective, sizes, ours=True, iters=iters, warmup=warmup)
            rows += sweep(collective, sizes, ours=False, iters=iters, warmup=warmup)
        rows += sweep("tree_all_reduce", sizes, ours=True, iters=iters, warmup=warmup)
    ping = ping_pong(sizes, iters=iters, warmup=warmup)
    hidden = overlap_on_rank(**overlap) if overlap is not None else None
    return {"rows": rows, "ping_pong": ping, "overlap": hidden} if dist.get_rank() == 0 else None


def measured_crossover(rows: list[dict]) -> int | None:
    """Smallest size from which our ring all-reduce beats our tree at every larger size."""
    ours = [r for r in rows if r["impl"] == "ours"]
    ring, tree = ({r["bytes"]: r["time_s"] for r in ours if r["algorithm"] == algorithm}
                  for algorithm in ("ring_all_reduce", "tree_all_reduce"))
    return first_win(ring, tree)


def first_win(a: dict[int, float], b: dict[int, float]) -> int | None:
    """Smallest size from which times `a` beat times `b` ({bytes: s}) at every larger size."""
    sizes = sorted(set(a) & set(b))
    wins = [a[s] < b[s] for s in sizes]
    if not wins or not wins[-1]:
        return None
    i = len(sizes) - 1
    while i > 0 and wins[i - 1]:
        i -= 1
    return sizes[i]
