"""NCCL without torch.distributed: what `init_process_group("nccl")` wraps, by hand.

An NCCL communicator is created in three moves, and torch.distributed does exactly these:

1. one rank calls ``ncclGetUniqueId`` — 128 opaque bytes naming a rendezvous (it holds
   the address of a bootstrap socket on that rank);
2. those bytes reach every other rank by some side channel NCCL does not provide
   (torch uses its TCPStore; MPI programs use ``MPI_Bcast``; here the gloo group);
3. every rank calls ``ncclCommInitRank(world, uid, rank)`` on its own GPU; NCCL then
   discovers the topology (NVLink, PCIe, NICs) and builds its rings and trees.

After that a collective is one call on raw device pointers and a CUDA stream:
``allReduce(sendptr, recvptr, count, NCCL_FLOAT32, NCCL_SUM, stream)``. It is
asynchronous: it enqueues kernels on ``stream`` and returns; synchronize the stream to
wait. ``nccl_example`` does this with ``cupy.cuda.nccl`` in one process per GPU and
checks the sum (rank r contributes r + 1, so each element must be world(world+1)/2).
"""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from layer1_kernels import cupy_available

from .cost_model import busbw
from .launch import launch


def _require(world_size: int | None) -> int:
    """The number of ranks to use, or a RuntimeError saying what is missing."""
    if not torch.cuda.is_available():
        raise RuntimeError("nccl_example drives NCCL on CUDA GPUs, and no CUDA GPU is visible "
                           "(torch.cuda.is_available() is False); collectives on this machine "
                           "run through gloo instead")
    if not cupy_available():
        raise RuntimeError("nccl_example needs CuPy with CUDA (pip install cupy-cuda12x or "
                           "cupy-cuda13x to match your CUDA); CuPy is not importable here")
    try:
        from cupy.cuda import nccl  # noqa: F401
    except Exception as err:  # CuPy built without NCCL, or libnccl missing
        raise RuntimeError(f"this CuPy has no NCCL binding (cupy.cuda.nccl): {err}") from err
    gpus = torch.cuda.device_count()
    world = gpus if world_size is None else world_size
    if world < 2 or world > gpus:
        raise RuntimeError(f"nccl_example needs 2 or more GPUs, one per rank; asked for "
                           f"{world} rank(s) and {gpus} GPU(s) are visible")
    return world


def _rank_main(count: int, iters: int) -> dict:
    """One rank: get the uid to everyone over gloo, build the communicator, all-reduce."""
    import cupy
    from cupy.cuda import nccl

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on these machines
    world, me = dist.get_world_size(), dist.get_rank()
    local = int(os.environ.get("LOCAL_RANK", me))
    box = [nccl.get_unique_id() if me == 0 else None]
    dist.broadcast_object_list(box, src=0)  # the side channel: gloo carries the 128 bytes
    with cupy.cuda.Device(local):
        comm = nccl.NcclCommunicator(world, box[0], me)
        try:
            stream = cupy.cuda.Stream(non_blocking=True)
            with stream:  # fill on the stream NCCL will read from, so the order is guaranteed
                send = cupy.full(count, me + 1, dtype=cupy.float32)
                recv = cupy.empty_like(send)

            def all_reduce() -> None:
                comm.allReduce(send.data.ptr, recv.data.ptr, count, nccl.NCCL_FLOAT32,
                               nccl.NCCL_SUM, stream.ptr)

            all_reduce()  # first call also finishes NCCL's lazy connection setup
            stream.synchronize()
            expected = world * (world + 1) / 2
            with stream:
                max_error = float(cupy.abs(recv - expected).max())
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record(stream)
            for _ in range(iters):
                all_reduce()
            end.record(stream)
            end.synchronize()
            seconds = cupy.cuda.get_elapsed_time(start, end) / 1e3 / iters
        finally:
            comm.destroy()
    nbytes = count * 4
    algbw = nbytes / seconds
    version = getattr(nccl, "get_version", lambda: None)()
    return {"rank": me, "world": world, "device": local, "count": count, "bytes": nbytes,
            "ok": max_error == 0.0, "max_error": max_error, "expected": expected,
            "time_s": seconds, "algbw": algbw, "busbw": busbw(algbw, "all_reduce", world),
            "nccl_version": version}


def nccl_example(world_size: int | None = None, *, count: int = 1 << 24, iters: int = 20,
                 timeout_s: float = 180.0) -> dict:
    """All-reduce ``count`` fp32 values across ``world_size`` GPUs (default: all) with raw NCCL.

    Returns rank 0's result (``ok``, ``max_error``, ``time_s``, ``algbw``, ``busbw``,
    ``nccl_version``) with ``ok`` true only if every rank got the exact sum. Raises
    RuntimeError without CUDA, without CuPy's NCCL binding, or with fewer than 2 GPUs.
    """
    world = _require(world_size)
    if count < 1 or iters < 1:
        raise ValueError(f"count and iters must be >= 1, got {count}, {iters}")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    t0 = time.perf_counter()
    # gloo here is only the side channel for the uid; NCCL itself is driven through CuPy.
    results = launch(_rank_main, world, count, iters, backend="gloo", timeout_s=timeout_s)
    return {**results[0], "ok": all(r["ok"] for r in results),
            "wall_s": time.perf_counter() - t0}
