"""Measure the tuning knobs (tuning.py) instead of trusting them: pieces, lanes, check.

Run on every rank of a process group (`python -m layer2_comm.commands tune` launches the
ranks). At each size (64 MiB and 256 MiB by default on GPUs):

1. **The ring step**, alone: send a segment (size/p bytes) to the right-hand neighbour
   while receiving one from the left, through `exchange`, with 1, 2 and 4 lanes. Every
   step of our ring is this, so its bandwidth (per direction) is the ceiling of the ring's
   busbw — whatever the pipelining does, a ring cannot beat its own step. If the step is
   slow, the transport is the limit; if the step is fast and the ring is not, the schedule is.
2. **Ours** — all-reduce, all-gather, reduce-scatter — for every (lanes, chunk_bytes) in a
   small grid, each beside torch.distributed's built-in at the same size (busbw ratio), and
   with the host time per call: how long a call takes to return without waiting for the
   GPU. When it exceeds the GPU time the GPU waits on Python, and fewer pieces would help.
3. **The check's cost**: our all-reduce at small sizes with the header check on and off.

Each timing is the sweep's (bandwidth.sweep): checked once on exact integer data, then
CUDA events back to back, slowest rank, median.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from . import tuning
from .bench_bandwidth import iters_at, sweep, time_collective
from .group import device, lane_groups
from .p2p import exchange, ring_neighbours
from .ring import ring_all_gather, ring_all_reduce, ring_reduce_scatter

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
CALLS: dict[str, Callable[[torch.Tensor], object]] = {
    "all_reduce": ring_all_reduce,
    "all_gather": ring_all_gather,
    "reduce_scatter": ring_reduce_scatter,
}
ONE_PIECE = 1 << 62  # a chunk size no segment reaches: the unpipelined ring


def step_bandwidth(nbytes: int, lanes: int, iters: int, warmup: int) -> dict:
    """One ring step of ``nbytes`` per direction with ``lanes`` lanes: seconds and bytes/s."""
    dev, me = device(), dist.get_rank()
    prev, nxt = ring_neighbours(list(range(dist.get_world_size())), me)
    out = torch.zeros(max(1, nbytes // 4), device=dev)
    into = torch.empty_like(out)
    with tuning.override(lanes=lanes):
        lane_groups(lanes)  # made here by every rank, before any rank's first striped message

        def step() -> None:
            exchange([(out, nxt)], [(into, prev)], what="ring step").wait()

        t = statistics.median(time_collective(step, *iters_at(nbytes, iters, warmup), dev))
    return {"kind": "ring step", "bytes": out.numel() * 4, "lanes": lanes, "time_s": t,
            "bytes_per_s": out.numel() * 4 / t}


def host_time(fn: Callable[[], object], calls: int = 5) -> float:
    """Seconds for a call to return, not counting the GPU finishing it (CPU: the whole call)."""
    dev = device()
    fn()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    spent = (time.perf_counter() - start) / calls
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return spent


def _host_time_of(collective: str, nbytes: int) -> float:
    """Host seconds per call of our `collective` on a float32 tensor of about ``nbytes``."""
    p = dist.get_world_size()
    count = max(1, nbytes // 4)
    if collective == "all_gather":  # nbytes is the gathered output, as in the sweep
        count = max(1, count // p)
    x = torch.ones(count, device=device())
    return host_time(lambda: CALLS[collective](x))


def tune_rank(sizes: Sequence[int], iters: int = 10, warmup: int = 3,
              lanes_grid: Sequence[int] = (1, 2, 4),
              chunk_grid: Sequence[int] = (16 << 20, 32 << 20, 64 << 20, ONE_PIECE),
              small_sizes: Sequence[int] = (8, 65536)) -> dict | None:
    """Everything above on this rank; rank 0 returns {"steps", "configs", "reference",
    "check", "defaults"}, the others None."""
    p = dist.get_world_size()
    if p < 2:
        raise RuntimeError("tune measures transfers between ranks: it needs at least 2")
    steps, configs, reference, check = [], [], [], []
    for nbytes in sizes:
        for lanes in lanes_grid:
            steps.append(step_bandwidth(-(-nbytes // p), lanes, iters, warmup))
        for collective in COLLECTIVES:
            reference += sweep(collective, [nbytes], ours=False, iters=iters, warmup=warmup)
            for lanes in lanes_grid:
                for chunk in chunk_grid:
                    with tuning.override(lanes=lanes, chunk_bytes=chunk) as t:
                        row = sweep(collective, [nbytes], ours=True, iters=iters, warmup=warmup)[0]
                        row.update(lanes=lanes, chunk_bytes=chunk if chunk != ONE_PIECE else None,
                                   pieces=t.pieces(-(-row["bytes"] // p)),
                                   host_s=_host_time_of(collective, row["bytes"]))
                    configs.append(row)
    for checked in (True, False):
        with tuning.override(check=checked):
            for row in sweep(
                "all_reduce", list(small_sizes), ours=True, iters=iters, warmup=warmup
            ):
                check.append({**row, "check": checked})
    check += sweep("all_reduce", list(small_sizes), ours=False, iters=iters, warmup=warmup)
    defaults = tuning.current()
    if dist.get_rank() != 0:
        return None
    return {
        "steps": steps,
        "configs": configs,
        "reference": reference,
        "check": check,
        "defaults": {
            "chunk_bytes": defaults.chunk_bytes,
            "lanes": defaults.lanes,
            "max_pieces": defaults.max_pieces,
            "stripe_min_bytes": defaults.stripe_min_bytes,
        },
    }


def best_configs(result: dict) -> list[dict]:
    """Per (collective, bytes): the default config's row, the best row, and the built-in's."""
    ref = {(r["collective"], r["bytes"]): r for r in result["reference"]}
    d = result["defaults"]
    out = []
    for key in sorted({(r["collective"], r["bytes"]) for r in result["configs"]}):
        rows = [r for r in result["configs"] if (r["collective"], r["bytes"]) == key and r["ok"]]
        if not rows:
            continue
        best = max(rows, key=lambda r: r["busbw"])
        default = next(
            (r for r in rows if r["lanes"] == d["lanes"] and r["chunk_bytes"] == d["chunk_bytes"]),
            None,
        )
        out.append({"collective": key[0], "bytes": key[1], "best": best, "default": default,
                    "torch": ref.get(key)})
    return out
