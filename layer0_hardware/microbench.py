"""Microbenchmarks that measure this machine's ceilings.

Every benchmark follows the same method: random data (never zeros -- some hardware and
libraries short-cut zeros, and compressible data can flatter a memory system), sizes large
enough to spill out of the caches, untimed warm-up calls, then repeated timings from
``time_fn`` (CUDA events on a GPU). Results are rates: bytes/s or FLOP/s.

Which repeat to report depends on the question. "How fast is this op?" is the median (a
typical run). "How fast can this machine go?" -- a *ceiling* -- is the fastest repeat
(``peak=True``): interference from other work only ever slows a run down, so on a busy
machine the median under-states the ceiling, and then the ops measured against it
(``points.py``, the layers above) land above 100 % of their roof.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch

from .fp8 import fp8_matmul_fn
from .timing import resolve_device, time_fn

MiB = 2**20
MATMUL_DTYPES = ("fp32", "tf32", "fp16", "bf16", "fp8")
CPU_MATMUL_DTYPES = ("fp32", "bf16")
_TORCH_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16,
                 "bf16": torch.bfloat16}
# n = 8192 keeps every SM of an H100 busy; on CPU such a matmul takes seconds, and n = 1024
# already reaches the BLAS plateau there.
_DEFAULT_MATMUL_N = {"cuda": 8192, "cpu": 1024}
_RANDOM_BLOCK = 2**20  # elements generated per distinct random block on CPU
_PEAK_REPEATS = {"cuda": 20, "cpu": 9}  # more chances for one undisturbed run
_CPU_PEAK_BUDGET_S = 2.0  # of a CPU's peak repeats, beyond the first 3


def _check_positive_int(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_floats(numel: int, device: torch.device) -> torch.Tensor:
    """``numel`` uniform random fp32 values on ``device``.

    The GPU generates random numbers at memory speed. A CPU core is ~50x slower at it,
    so there we tile a 4 MiB random block: the data is still non-zero and incompressible
    to the memory system, and building a 256 MiB buffer stays well under a second.
    """
    if device.type == "cuda" or numel <= _RANDOM_BLOCK:
        return torch.rand(numel, device=device)
    block = torch.rand(_RANDOM_BLOCK, device=device)
    reps = -(-numel // _RANDOM_BLOCK)  # ceiling division
    return block.repeat(reps)[:numel].contiguous()


def _seconds(fn: Callable[[], object], dev: torch.device, *, peak: bool, repeats: int,
             warmup: int = 2) -> float:
    """Median seconds of fn, or with ``peak`` the fastest of more repeats (see above)."""
    if peak:
        repeats = _PEAK_REPEATS.get(dev.type, 9)
        if dev.type != "cuda":  # a slow CPU path (bf16 without native support: seconds a
            # matmul) gets as many repeats as fit its time budget, at least 3
            for _ in range(max(warmup, 1)):
                start = time.perf_counter()
                fn()
                once = time.perf_counter() - start
                if once > _CPU_PEAK_BUDGET_S:  # slow enough: warm after one call
                    break
            fit = int(_CPU_PEAK_BUDGET_S / max(once, 1e-9))
            return time_fn(fn, warmup=0, repeats=max(3, min(repeats, fit)), device=dev).min_s
        return time_fn(fn, warmup=warmup, repeats=repeats, device=dev).min_s
    return time_fn(fn, warmup=warmup, repeats=repeats, device=dev).median_s


def copy_bandwidth(device: torch.device | str | None = None, nbytes: int = 256 * MiB, *,
                   peak: bool = False) -> float:
    """Memory bandwidth in bytes/s from ``dst.copy_(src)`` of ``nbytes`` bytes (fp32 data).

    Counts bytes read plus bytes written (2 * nbytes per copy), the traffic DRAM serves.
    The default 256 MiB is far beyond any GPU's L2 (50 MB on H100) and most CPUs' L3;
    on a CPU a call takes ~0.3 s. peak: the fastest repeat instead of the median.
    """
    dev = resolve_device(device)
    _check_positive_int("nbytes", nbytes)
    numel = max(nbytes // 4, 1)
    src = random_floats(numel, dev)
    dst = torch.empty_like(src)
    # GPU copies take milliseconds, so many repeats are cheap; CPU ones take ~20 ms each.
    repeats = 20 if dev.type == "cuda" else 5
    return 2 * numel * 4 / _seconds(lambda: dst.copy_(src), dev, peak=peak, repeats=repeats)


def memory_bandwidth(device: torch.device | str | None = None, nbytes: int = 256 * MiB) -> float:
    """The memory ceiling in bytes/s: the faster of two streams over ``nbytes`` buffers,
    each at its fastest repeat -- a copy (1 read + 1 write) and an add (2 reads + 1 write).

    Why both: a store to a line not in cache first reads it ("write-allocate" on CPUs), and
    that hidden read costs a copy relatively more than an add, so on a CPU ``torch.add``
    shows more bytes/s than ``copy_``; a roof taken from the copy alone sits below what
    elementwise ops reach.
    """
    dev = resolve_device(device)
    _check_positive_int("nbytes", nbytes)
    numel = max(nbytes // 4, 1)
    a, b = random_floats(numel, dev), random_floats(numel, dev)
    out = torch.empty_like(a)
    added = 3 * numel * 4 / _seconds(lambda: torch.add(a, b, out=out), dev, peak=True,
                                     repeats=1)
    copied = 2 * numel * 4 / _seconds(lambda: out.copy_(a), dev, peak=True, repeats=1)
    return max(added, copied)


def host_device_bandwidth(pinned: bool, direction: str = "h2d", nbytes: int = 256 * MiB) -> float:
    """Host<->GPU copy bandwidth in bytes/s (bytes transferred / time), over PCIe or C2C.

    pinned: page-locked host memory, which the GPU's DMA engines read directly; pageable
    memory is first staged through a pinned buffer by the driver, so it is slower.
    direction: "h2d" (host to device) or "d2h". Needs CUDA (RuntimeError otherwise).
    """
    if direction not in ("h2d", "d2h"):
        raise ValueError(f"direction must be 'h2d' or 'd2h', got {direction!r}")
    _check_positive_int("nbytes", nbytes)
    if not torch.cuda.is_available():
        raise RuntimeError("host_device_bandwidth measures host<->GPU copies and needs a CUDA "
                           "GPU; none is available on this machine")
    dev = resolve_device("cuda")
    numel = max(nbytes // 4, 1)
    host = random_floats(numel, torch.device("cpu"))
    if pinned:
        host = host.pin_memory()
    gpu = torch.rand(numel, device=dev)
    if direction == "h2d":
        def fn() -> None:
            gpu.copy_(host, non_blocking=pinned)  # async DMA only from pinned memory
    else:
        def fn() -> None:
            host.copy_(gpu, non_blocking=pinned)
    timing = time_fn(fn, warmup=2, repeats=10, device=dev)
    return numel * 4 / timing.median_s


@contextlib.contextmanager
def tf32_matmul(enabled: bool) -> Iterator[None]:
    """Turn TF32 tensor-core math for fp32 matmuls on or off, restoring the old setting.

    torch >= 2.9 replaced ``allow_tf32`` with ``fp32_precision`` and raises if the two APIs
    are mixed, so we use the new one when it exists.
    """
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        saved = matmul.fp32_precision
        matmul.fp32_precision = "tf32" if enabled else "ieee"
        try:
            yield
        finally:
            matmul.fp32_precision = saved
    else:
        saved = matmul.allow_tf32
        matmul.allow_tf32 = enabled
        try:
            yield
        finally:
            matmul.allow_tf32 = saved


def _matmul_fn(dtype: str, n: int, dev: torch.device) -> Callable[[], object]:
    if dtype == "fp8":
        return fp8_matmul_fn(n, dev)
    torch_dtype = _TORCH_DTYPES[dtype]
    a = torch.randn(n, n, device=dev, dtype=torch_dtype)
    b = torch.randn(n, n, device=dev, dtype=torch_dtype)
    out = torch.empty(n, n, device=dev, dtype=torch_dtype)
    return lambda: torch.matmul(a, b, out=out)


def matmul_flops(dtype: str = "bf16", n: int | None = None,
                 device: torch.device | str | None = None, *, peak: bool = False) -> float:
    """Matmul throughput in FLOP/s: 2 * n^3 / median time of an n x n @ n x n product.

    dtype: 'fp32' (TF32 off), 'tf32' (fp32 storage, TF32 tensor cores), 'fp16', 'bf16',
    'fp8' (e4m3 via torch._scaled_mm, compute capability >= 8.9, else NotImplementedError).
    CPU supports 'fp32' and 'bf16' (on every core torch uses). Default n: 8192 on CUDA,
    1024 on CPU. peak: the fastest repeat instead of the median (for a ceiling).
    """
    dev = resolve_device(device)
    supported = MATMUL_DTYPES if dev.type == "cuda" else CPU_MATMUL_DTYPES
    if dtype not in supported:
        raise ValueError(f"unsupported matmul dtype {dtype!r} on {dev.type}; "
                         f"choose one of {supported}")
    n = _DEFAULT_MATMUL_N.get(dev.type, 1024) if n is None else n
    _check_positive_int("n", n)
    fn = _matmul_fn(dtype, n, dev)
    # Long GPU matmuls need few repeats; CPU ones are slow, so keep the count small.
    repeats = 10 if dev.type == "cuda" else 5
    if dev.type == "cuda":
        with tf32_matmul(dtype == "tf32"):
            seconds = _seconds(fn, dev, peak=peak, repeats=repeats, warmup=3)
    else:
        seconds = _seconds(fn, dev, peak=peak, repeats=repeats)
    return 2.0 * n**3 / seconds


def launch_latency(device: torch.device | str | None = None) -> float:
    """Seconds per launch of a tiny op, from a burst of back-to-back in-place adds.

    On a GPU the adds take ~1 us of GPU time each, so the burst's wall time divided by its
    length is what the host needs to issue one kernel (the cost that dominates small-batch
    decoding). On CPU it is torch's per-op dispatch overhead.
    """
    dev = resolve_device(device)
    launches = 1000 if dev.type == "cuda" else 200
    x = torch.rand(16, device=dev)

    def burst_seconds() -> float:
        _sync(dev)
        start = time.perf_counter()
        for _ in range(launches):
            x.add_(1.0)
        _sync(dev)  # the burst ends when the GPU has run the last add
        return time.perf_counter() - start

    for _ in range(2):  # warm-up: first launches load the kernel and grow the allocator
        burst_seconds()
    samples = sorted(burst_seconds() for _ in range(7))
    return samples[len(samples) // 2] / launches
