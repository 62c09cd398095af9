"""Timing GPU and CPU work correctly.

Two traps make naive timings wrong: (1) CUDA launches are *asynchronous* -- ``fn()``
returns as soon as the kernel is queued, so a host clock around it measures the launch,
not the work; (2) the first calls pay one-off costs (cuBLAS heuristics, allocator growth,
clock ramp-up, cold caches). So: warm up untimed, synchronize (or use CUDA events, which
the GPU timestamps itself), repeat, and report the *median*, which ignores the odd slow
outlier (an OS interrupt, a GC pause) that would drag a mean.
"""
from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Timing:
    """Repeated timings of one function, all in seconds."""

    median_s: float
    min_s: float
    mean_s: float
    samples: list[float]

    @classmethod
    def from_samples(cls, samples: list[float]) -> Timing:
        """Summarise a non-empty list of per-call durations in seconds."""
        if not samples:
            raise ValueError("need at least one sample to summarise")
        return cls(
            median_s=statistics.median(samples),
            min_s=min(samples),
            mean_s=statistics.fmean(samples),
            samples=list(samples),
        )


def _check_counts(warmup: int, repeats: int) -> None:
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_time(fn: Callable[[], object], *, warmup: int = 3, repeats: int = 10) -> float:
    """Median wall-clock seconds of ``fn()`` over ``repeats`` calls, after ``warmup`` calls.

    The device is synchronized before starting and after each call, so queued GPU work is
    counted where it belongs.
    """
    _check_counts(warmup, repeats)
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        _sync()  # start from an idle GPU: earlier work must not count against this call
        start = time.perf_counter()
        fn()
        _sync()  # wait for the work fn() queued, not just for its launch
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def resolve_device(device: torch.device | str | None) -> torch.device:
    """``None`` -> the current CUDA device (or CPU); otherwise a checked torch.device."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {dev} requested but CUDA is not available on this machine")
    return dev


def time_fn(
    fn: Callable[[], object],
    *,
    warmup: int = 3,
    repeats: int = 20,
    device: torch.device | str | None = None,
) -> Timing:
    """Time ``fn()`` ``repeats`` times after ``warmup`` untimed calls.

    On a CUDA device each repetition is bracketed by a pair of CUDA events recorded on the
    current stream: the GPU timestamps them itself, so the result is GPU execution time
    without host overhead, and we synchronize only once at the end. On CPU it uses
    ``time.perf_counter``. ``device=None`` means CUDA when available, else CPU.
    """
    _check_counts(warmup, repeats)
    dev = resolve_device(device)
    for _ in range(warmup):
        fn()
    if dev.type != "cuda":
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return Timing.from_samples(samples)

    with torch.cuda.device(dev):
        torch.cuda.synchronize()  # the warm-up must not spill into the first timed call
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        for start, end in zip(starts, ends, strict=True):
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()  # elapsed_time needs both events to have completed
        samples = [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends, strict=True)]  # ms -> s
    return Timing.from_samples(samples)


def python_loop_ms() -> float:
    """A fixed pure-Python loop (200k iterations), in ms: how fast this host runs Python now.
    A host-bound figure (eager launches, a prefill's host side) follows it, and a shared host's
    can move 2x within a minute, so benchmarks record it beside such figures."""
    t0 = time.perf_counter()
    acc = 0
    for i in range(200_000):
        acc += i & 7
    return (time.perf_counter() - t0) * 1e3


def timed_into(fn: Callable, add: Callable[[float], object],
               clock: Callable[[], float] = time.perf_counter) -> Callable:
    """fn, wrapped: each call's seconds by `clock` go to add(seconds), also when it raises.
    Where a program's time goes, stage by stage, without a profiler's overhead on every call
    (a CUDA launch is timed as a launch: see the module docstring). time.thread_time as the
    clock leaves out what other processes take from this thread on a shared machine."""
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        start = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            add(clock() - start)
    return timed
