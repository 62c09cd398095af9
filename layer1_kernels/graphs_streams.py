"""Two ways to stop a GPU from waiting: CUDA graphs and CUDA streams (torch.cuda, GPU only).

CUDA graphs. Each kernel launch costs the CPU a few microseconds (Python, the framework's
dispatch, the driver). A kernel that runs for one microsecond then leaves the GPU idle
most of the time: decoding one token in an LLM is hundreds of such tiny kernels. A
`torch.cuda.CUDAGraph` records a sequence of launches once and replays the whole sequence
with ONE launch, so the per-kernel CPU cost disappears. `cuda_graph_demo` measures it.

Streams. A stream is a queue of GPU work that runs in order; work on different streams may
overlap. The copy engines move host memory to the GPU while the SMs compute, but only if
the copy is on another stream than the compute and the host buffer is pinned (page-locked,
so the DMA engine can read it without the CPU staging it). `stream_overlap_demo` copies on
a side stream while multiplying matrices on the default one, orders the two with events
(`wait_stream`), and tells the caching allocator about the cross-stream use with
`record_stream`.

Both demos check that their results are exactly those of the plain, serial computation.
Without CUDA they raise RuntimeError.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from layer0_hardware import time_fn


def _require_cuda(what: str) -> torch.device:
    if not torch.cuda.is_available():
        raise RuntimeError(f"{what} needs a CUDA GPU: torch.cuda.is_available() is False")
    return torch.device("cuda", torch.cuda.current_device())


def _time_ms(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    """Median milliseconds of fn() on the current CUDA device (layer 0's event timer)."""
    return time_fn(fn, warmup=warmup, repeats=repeats, device="cuda").median_s * 1e3


def cuda_graph_demo(n_launches: int = 1000, size: int = 1024, repeats: int = 5) -> dict:
    """Time n_launches tiny kernels launched one by one, then as one replayed CUDA graph.

    The work: y = x, then n_launches times y += 0.001 * x (one small kernel each) on a
    `size`-element float32 tensor. Returns eager_ms, graph_ms, eager_us_per_launch,
    graph_us_per_launch, saved_us_per_launch, speedup, and results_match (the replay's y
    equals the eager y bit for bit; a RuntimeError is raised if it does not).
    """
    if n_launches < 1 or size < 1 or repeats < 1:
        raise ValueError("n_launches, size and repeats must be positive")
    device = _require_cuda("cuda_graph_demo")
    x = torch.randn(size, device=device)
    y = torch.empty_like(x)  # graphs replay on fixed addresses: reuse the same buffers

    def chain() -> None:
        y.copy_(x)
        for _ in range(n_launches):
            y.add_(x, alpha=1e-3)

    eager_ms = _time_ms(chain, repeats)
    eager_y = y.clone()

    # Capture: warm up on a side stream first (lazy initialisation must not be captured),
    # then record the launches into the graph instead of running them.
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        chain()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()

    y.fill_(float("nan"))  # so the check below proves the replay wrote y
    graph_ms = _time_ms(graph.replay, repeats)
    torch.cuda.synchronize(device)
    if not torch.equal(y, eager_y):
        raise RuntimeError("CUDA graph replay produced a different result from eager execution")

    launches = n_launches + 1
    return {
        "n_launches": launches,
        "size": size,
        "eager_ms": eager_ms,
        "graph_ms": graph_ms,
        "eager_us_per_launch": 1e3 * eager_ms / launches,
        "graph_us_per_launch": 1e3 * graph_ms / launches,
        "saved_us_per_launch": 1e3 * (eager_ms - graph_ms) / launches,
        "speedup": eager_ms / graph_ms if graph_ms > 0 else float("inf"),
        "results_match": True,
    }


def stream_overlap_demo(copy_mb: int = 256, matmul_n: int = 4096, repeats: int = 5) -> dict:
    """Overlap a pinned host-to-device copy (side stream) with matmuls (default stream).

    The number of (matmul_n x matmul_n float32) matmuls is chosen so that compute takes
    about as long as the copy of `copy_mb` MB, where overlap pays most. Returns copy_ms,
    compute_ms (each alone), serial_ms (one after the other), overlapped_ms, and
    overlap_efficiency = (serial - overlapped) / min(copy, compute): 1.0 means the shorter
    one was hidden completely, 0 means no overlap. Also n_matmuls, copy_gb_per_s and
    results_match (raises RuntimeError if the copy or the product differs from serial).
    """
    if copy_mb < 1 or matmul_n < 1 or repeats < 1:
        raise ValueError("copy_mb, matmul_n and repeats must be positive")
    device = _require_cuda("stream_overlap_demo")
    default = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)

    host = torch.randn(copy_mb * 2**20 // 4).pin_memory()  # pinned: the DMA engine reads it
    a = torch.randn(matmul_n, matmul_n, device=device)
    b = torch.randn(matmul_n, matmul_n, device=device)
    c = torch.empty(matmul_n, matmul_n, device=device)
    dst = torch.empty(host.shape, device=device)

    def copy() -> None:
        dst.copy_(host, non_blocking=True)

    copy_ms = _time_ms(copy, repeats)
    one_mm_ms = _time_ms(lambda: torch.matmul(a, b, out=c), repeats)
    n_matmuls = max(1, min(64, round(copy_ms / one_mm_ms)))

    def compute() -> None:
        for _ in range(n_matmuls):
            torch.matmul(a, b, out=c)

    compute_ms = _time_ms(compute, repeats)
    serial_ms = _time_ms(lambda: (copy(), compute()), repeats)
    expected_c = c.clone()

    last: list[torch.Tensor] = []

    def overlapped() -> None:
        # A fresh destination each time: allocated on the default stream, written on the
        # side stream. record_stream tells the caching allocator not to hand its memory to
        # anyone else until the side stream's work on it is done.
        out = torch.empty(host.shape, device=device)
        side.wait_stream(default)  # the side stream starts after what came before
        with torch.cuda.stream(side):
            out.copy_(host, non_blocking=True)
        out.record_stream(side)
        compute()  # meanwhile, on the default stream
        default.wait_stream(side)  # later default-stream work sees the finished copy
        last[:] = [out]

    c.fill_(float("nan"))
    overlapped_ms = _time_ms(overlapped, repeats)
    torch.cuda.synchronize(device)
    if not (torch.equal(last[0].cpu(), host) and torch.equal(c, expected_c)):
        raise RuntimeError("overlapped copy/compute produced a different "
                           "result from the serial run")

    hidden = serial_ms - overlapped_ms
    return {
        "copy_mb": copy_mb,
        "matmul_n": matmul_n,
        "n_matmuls": n_matmuls,
        "copy_ms": copy_ms,
        "compute_ms": compute_ms,
        "serial_ms": serial_ms,
        "overlapped_ms": overlapped_ms,
        "overlap_efficiency": hidden / min(copy_ms, compute_ms),
        "copy_gb_per_s": copy_mb * 2**20 / 1e6 / copy_ms,
        "results_match": True,
    }
