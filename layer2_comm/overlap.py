"""Hiding communication behind compute: a matmul runs while a large all-reduce proceeds.

Training and serving both have work that does not depend on the collective in flight
(the next layer's matmul while the last layer's gradients are reduced; the other
micro-batch in tensor-parallel decoding). Start the all-reduce without waiting for it
(``async_op=True`` returns a work handle; on GPUs NCCL runs it on its own internal
stream), run the matmuls on the default stream, then ``work.wait()``. Three times:

    t_comm  the all-reduce alone          t_comp  the matmuls alone
    t_both  both, overlapped
    overlap efficiency = (t_comp + t_comm - t_both) / min(t_comp, t_comm)

The number of matmuls is calibrated so that t_comp >= t_comm (rounded up, the same on
every rank), so min() is t_comm and the efficiency is **the share of the communication
hidden**: 1.0 = all of it, 0 = they ran one after the other, below 0 = running them
together slowed both down (on a CPU they fight over the same cores).

Why a GPU stays a little under 1: NCCL's kernels hold SMs for the whole all-reduce (one
thread block per channel: 16-32 of an H200's 132), so the matmul runs on the rest, ~20%
slower while they overlap, and that slowdown is time the overlap did not save. Three
variants show it:
- ``efficiency``: the async handle, as above;
- ``side_stream_efficiency`` (CUDA): the blocking all-reduce issued inside
  ``torch.cuda.stream(side)`` — the "separate CUDA stream" way; the same thing underneath;
- ``lean_efficiency`` (CUDA): the all-reduce on a process group whose NCCL communicator may
  use at most ``lean_ctas`` thread blocks (``ProcessGroupNCCL.Options().config.max_ctas``):
  alone it is slower (fewer SMs move the data), but it takes fewer SMs from the matmul, so
  more of it hides. Frameworks turn this knob (``NCCL_MAX_CTAS``, per-group options) when
  communication is meant to run under compute, and leave NCCL all the SMs when it is not.
On a CPU with gloo both need the same few cores, so on a 2-core laptop expect little overlap.
"""
from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from .group import barrier, device
from .launch import launch


def _timed(fn: Callable[[], object], iters: int, warmup: int, dev: torch.device) -> float:
    """Median over iterations of the slowest rank's wall time, each start barrier-aligned."""
    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        sync()
        barrier(dev)
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
    t = torch.tensor(samples, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return statistics.median(t.tolist())


def _lean_group(ctas: int):
    """A process group whose NCCL communicator uses at most ``ctas`` thread blocks, or None
    where this torch cannot say so. Every rank calls it (new_group is collective)."""
    options = getattr(getattr(dist, "ProcessGroupNCCL", None), "Options", None)
    if options is None:
        return None
    try:
        opts = options()
        opts.config.max_ctas = ctas
        opts.config.min_ctas = 1
    except (AttributeError, TypeError, RuntimeError):  # an older torch without NCCL's config
        return None
    return dist.new_group(backend="nccl", pg_options=opts)


def _agreed(count: int, dev: torch.device) -> int:
    """The largest of every rank's ``count`` (at least 1), so all ranks run the same work."""
    t = torch.tensor([max(1, count)], device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _overlapped(x: torch.Tensor, matmuls: Callable[[int], None], dev: torch.device, iters: int,
                warmup: int, t_one: float, group=None) -> dict:
    """t_comm, t_comp (>= t_comm), t_both and the efficiency for one way of all-reducing x."""
    t_comm = _timed(lambda: dist.all_reduce(x, group=group), iters, warmup, dev)
    # Enough matmuls to cover the all-reduce, so that min(t_comp, t_comm) is the communication.
    # Timings are the slowest rank's, the same everywhere, so every rank takes the same branch.
    reps = _agreed(math.ceil(t_comm / t_one), dev)
    t_comp = _timed(lambda: matmuls(reps), iters, warmup, dev)
    if t_comp < t_comm:  # a run of matmuls went faster than one alone suggested: once more
        reps = _agreed(max(reps + 1, math.ceil(reps * t_comm / t_comp)), dev)
        t_comp = _timed(lambda: matmuls(reps), iters, warmup, dev)

    def both() -> None:
        # returns at once; the reduce proceeds
        work = dist.all_reduce(x, group=group, async_op=True)
        matmuls(reps)
        work.wait()

    t_both = _timed(both, iters, warmup, dev)
    return {"t_comm_s": t_comm, "t_comp_s": t_comp, "t_both_s": t_both, "matmuls": reps,
            "efficiency": efficiency(t_comp, t_comm, t_both), "both": both}


def overlap_on_rank(comm_bytes: int | None = None, matmul_n: int | None = None,
                    iters: int = 5, warmup: int = 2, lean_ctas: int = 8) -> dict:
    """Measure overlap on this rank of an initialized process group (call on every rank).

    Defaults: a 256 MiB fp32 all-reduce against 4096^2 bf16 matmuls on CUDA; a 4 MiB
    all-reduce against 192^2 fp32 matmuls on CPU. ``lean_ctas``: the thread-block limit of
    the lean variant (CUDA only; 0 skips it).
    """
    dev = device()
    cuda = dev.type == "cuda"
    comm_bytes = comm_bytes or (256 << 20 if cuda else 4 << 20)
    n = matmul_n or (4096 if cuda else 192)
    dtype = torch.bfloat16 if cuda else torch.float32
    world, me = dist.get_world_size(), dist.get_rank()
    if not cuda:  # ranks share this machine's cores: oversubscribed OpenMP threads spin and thrash
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    x = torch.ones(max(1, comm_bytes // 4), dtype=torch.float32, device=dev)
    gen = torch.Generator(device=dev).manual_seed(me)
    a = torch.randn(n, n, dtype=dtype, device=dev, generator=gen)
    b = torch.randn(n, n, dtype=dtype, device=dev, generator=gen)
    c = torch.empty(n, n, dtype=dtype, device=dev)

    def matmuls(reps: int) -> None:
        for _ in range(reps):
            torch.matmul(a, b, out=c)

    t_one = _timed(lambda: matmuls(1), iters, warmup, dev)
    plain = _overlapped(x, matmuls, dev, iters, warmup, t_one)
    both = plain.pop("both")
    out = {
        "backend": dist.get_backend(),
        "device": str(dev),
        "world": world,
        "rank": me,
        "comm_bytes": x.numel() * 4,
        "matmul_n": n,
        "matmul_dtype": str(dtype).removeprefix("torch."),
        **plain,
        "cpu_threads": torch.get_num_threads(),
    }
    if cuda:
        out["sms"] = torch.cuda.get_device_properties(dev).multi_processor_count
        side = torch.cuda.Stream(device=dev)
        reps = plain["matmuls"]

        def both_side_stream() -> None:
            # x is ready before the reduce reads it
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                dist.all_reduce(x)
            matmuls(reps)
            torch.cuda.current_stream(dev).wait_stream(side)

        out["t_both_side_stream_s"] = t = _timed(both_side_stream, iters, warmup, dev)
        out["side_stream_efficiency"] = efficiency(plain["t_comp_s"], plain["t_comm_s"], t)
        lean = _lean_group(lean_ctas) if lean_ctas > 0 else None
        if lean is not None:
            measured = _overlapped(x, matmuls, dev, iters, warmup, t_one, group=lean)
            measured.pop("both")
            out.update({f"lean_{k}": v for k, v in measured.items()}, lean_ctas=lean_ctas)
    out["correct"] = _check(x, both, a, b, c, world, me)
    return out


def _check(x, both, a, b, c, world: int, me: int) -> bool:
    """One more overlapped run on fresh data: the sum and the product must both be right."""
    x.fill_(me + 1)
    both()
    reduced_ok = bool(torch.all(x == world * (world + 1) / 2))
    product_ok = bool(
        torch.allclose(c.float(), (a.float() @ b.float()), rtol=2e-2, atol=2e-1 * a.shape[0] ** 0.5)
    )
    flag = torch.tensor([int(reduced_ok and product_ok)], device=x.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def efficiency(t_comp: float, t_comm: float, t_both: float) -> float:
    """(t_comp + t_comm - t_both) / min(t_comp, t_comm): the share of the shorter one hidden."""
    shorter = min(t_comp, t_comm)
    return (t_comp + t_comm - t_both) / shorter if shorter > 0 else 0.0


def overlap_demo(world_size: int | None = None, *, comm_bytes: int | None = None,
                 matmul_n: int | None = None, iters: int = 5, warmup: int = 2, lean_ctas: int = 8,
                 backend: str = "auto", timeout_s: float = 180.0) -> dict:
    """Run the overlap measurement; returns rank 0's dict plus every rank's efficiency.

    Inside an initialized process group (torchrun) it runs on this rank. Otherwise it
    launches ``world_size`` ranks: default every GPU (NCCL) when there are two or more,
    else 2 gloo ranks on the CPU.
    """
    args = (comm_bytes, matmul_n, iters, warmup, lean_ctas)
    if dist.is_available() and dist.is_initialized():
        return overlap_on_rank(*args)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    world = world_size or (gpus if gpus >= 2 else 2)
    if backend == "auto":
        backend = "nccl" if gpus >= world else "gloo"
    results = launch(overlap_on_rank, world, *args, backend=backend, timeout_s=timeout_s)
    return {**results[0], "efficiency_per_rank": [r["efficiency"] for r in results]}
