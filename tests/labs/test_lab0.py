"""Lab 0 grader: the roofline model and measuring a device properly.

Graded through the `impl` fixture (tests/labs/conftest.py): the layer0_hardware package
under plain pytest, a student's exercises.py under `stack grade --lab 0`. The timing
exercises run on a virtual clock (below): no test here depends on how busy the machine is.
"""
from __future__ import annotations

import math
import random
import statistics
import time
import timeit
from collections.abc import Callable

import pytest
import torch

REFERENCE = "layer0_hardware"

rng = random.Random()  # fresh inputs every run: an answer must be right for any valid input


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


@pytest.mark.points(5)
def test_arithmetic_intensity(impl):
    for _ in range(20):
        flops, nbytes = rng.uniform(0, 1e15), rng.uniform(1, 1e12)
        assert _close(impl.arithmetic_intensity(flops, nbytes), flops / nbytes)
    with pytest.raises(ValueError):
        impl.arithmetic_intensity(1e9, 0)
    with pytest.raises(ValueError):
        impl.arithmetic_intensity(-1.0, 10)


@pytest.mark.points(5)
def test_ridge_point(impl):
    assert _close(impl.ridge_point(989e12, 3.35e12), 989e12 / 3.35e12)  # H100 SXM, bf16
    for _ in range(20):
        peak, bw = rng.uniform(1e9, 1e16), rng.uniform(1e9, 1e13)
        assert _close(impl.ridge_point(peak, bw), peak / bw)


@pytest.mark.points(10)
def test_attainable_flops_is_the_roofline(impl):
    for _ in range(50):
        peak, bw = rng.uniform(1e12, 1e15), rng.uniform(1e11, 5e12)
        ridge = peak / bw
        low, high = ridge * rng.uniform(0.01, 0.99), ridge * rng.uniform(1.01, 100)
        assert _close(impl.attainable_flops(low, peak, bw), low * bw)  # on the slope
        assert _close(impl.attainable_flops(high, peak, bw), peak)  # on the flat roof


@pytest.mark.points(10)
def test_classify_bound(impl):
    for _ in range(50):
        peak, bw = rng.uniform(1e12, 1e15), rng.uniform(1e11, 5e12)
        ridge = peak / bw
        assert impl.classify_bound(ridge * rng.uniform(0.01, 0.99), peak, bw) == "memory"
        assert impl.classify_bound(ridge * rng.uniform(1.01, 100), peak, bw) == "compute"


@pytest.mark.points(10)
def test_vector_add_cost(impl):
    for _ in range(10):
        n, b = rng.randint(1, 10**9), rng.choice([1, 2, 4, 8])
        flops, nbytes = impl.vector_add_cost(n, b)
        assert _close(flops, n) and _close(nbytes, 3 * n * b)


@pytest.mark.points(10)
def test_matmul_cost(impl):
    for _ in range(10):
        m, n, k = (rng.randint(1, 20000) for _ in range(3))
        b = rng.choice([1, 2, 4])
        flops, nbytes = impl.matmul_cost(m, n, k, b)
        assert _close(flops, 2 * m * n * k)
        assert _close(nbytes, (m * k + k * n + m * n) * b)


@pytest.mark.points(15)
def test_attention_decode_cost(impl):
    for _ in range(10):
        kv = rng.choice([1, 2, 4, 8])
        batch, heads = rng.randint(1, 64), kv * rng.choice([1, 2, 4])
        d, ctx = rng.choice([64, 128]), rng.randint(1, 32768)
        b = rng.choice([1, 2, 4])
        flops, nbytes = impl.attention_decode_cost(batch, heads, kv, d, ctx, b)
        assert _close(flops, 4 * batch * heads * ctx * d)
        assert _close(nbytes, (2 * batch * kv * ctx * d + 2 * batch * heads * d) * b)
    # Decode attention is memory-bound on every GPU: about one FLOP per byte with MHA.
    flops, nbytes = impl.attention_decode_cost(8, 32, 32, 128, 4096, 2)
    assert 0.9 < flops / nbytes < 1.1


# ---------------------------------------------------------------- timing, on a virtual clock
# A grader must give the same score to the same code on an idle laptop and on a shared,
# loaded machine, so the timing exercises are graded on a clock the grader moves: time
# passes only when the graded work runs, by an amount the grader chose, and the right
# answer is exact (to the clock's resolution, 1 ns). Real measurements are the notebook's.
CLOCKS = ("perf_counter", "monotonic", "time", "perf_counter_ns", "monotonic_ns", "time_ns")


class VirtualClock:
    """Every host clock a submission might read (time.perf_counter & co., in seconds or ns),
    frozen except when `advance` moves it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def reader(self, name: str) -> Callable[[], float | int]:
        if name.endswith("_ns"):
            return lambda: round(self.now * 1e9)
        return lambda: self.now


def virtual_clock(impl, monkeypatch: pytest.MonkeyPatch) -> VirtualClock:
    """Install a VirtualClock in the time module, timeit, and any clock function the graded
    module imported by name (`from time import perf_counter`)."""
    clock = VirtualClock()
    originals = {getattr(time, name): name for name in CLOCKS}
    for name in CLOCKS:
        monkeypatch.setattr(time, name, clock.reader(name))
    monkeypatch.setattr(timeit, "default_timer", clock.reader("perf_counter"))
    for attr, value in list(vars(impl).items()):
        if callable(value) and value in originals:
            monkeypatch.setattr(impl, attr, clock.reader(originals[value]))
    return clock


@pytest.mark.points(15)
def test_median_time_warms_up_and_ignores_outliers(impl, monkeypatch):
    clock = virtual_clock(impl, monkeypatch)
    for _ in range(5):
        warmup, repeats = rng.randint(1, 3), rng.choice([5, 7, 9, 11])
        timed = [rng.uniform(1e-3, 3e-3) for _ in range(repeats)]
        timed[rng.randrange(repeats)] = 0.5  # one outlier (a page fault, a context switch)
        durations = [1.0] * warmup + timed  # warm-up calls are slow (caches, lazy init)
        calls = []

        def fn(durations=durations, calls=calls):
            clock.advance(durations[len(calls)] if len(calls) < len(durations) else 10.0)
            calls.append(1)

        seconds = impl.median_time(fn, warmup=warmup, repeats=repeats)
        assert len(calls) == warmup + repeats, "call fn `warmup` times untimed, then `repeats`"
        assert math.isclose(seconds, statistics.median(timed), rel_tol=1e-3), (
            f"calls took {[round(d * 1e3, 3) for d in durations]} ms ({warmup} warm-up); the "
            f"median of the timed ones is {statistics.median(timed) * 1e3:.4f} ms, got "
            f"{seconds * 1e3:.4f} ms")


@pytest.mark.points(20)
def test_copy_bandwidth_is_measured(impl, monkeypatch):
    """Each dst.copy_(src) of n bytes takes 2n / bandwidth seconds on the virtual clock (n read,
    n written), so copy_bandwidth must return exactly that bandwidth, however busy the CPU."""
    clock = virtual_clock(impl, monkeypatch)
    bandwidth = rng.uniform(5e9, 100e9)
    copied = []
    real_copy = torch.Tensor.copy_

    def copy_(self, src, *args, **kwargs):
        out = real_copy(self, src, *args, **kwargs)
        nbytes = self.numel() * self.element_size()
        copied.append(nbytes)
        clock.advance(2 * nbytes / bandwidth)
        return out

    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    nbytes = rng.choice([1, 2, 4, 8]) * 2**20
    measured = impl.copy_bandwidth("cpu", nbytes)
    assert copied, "time dst.copy_(src) (see the docstring)"
    assert max(copied) == nbytes, f"copied {sorted(set(copied))} bytes; asked for {nbytes}"
    assert math.isfinite(measured) and math.isclose(measured, bandwidth, rel_tol=1e-3), (
        f"each copy of {nbytes} B took {2 * nbytes / bandwidth * 1e6:.1f} us on the grader's "
        f"clock: {bandwidth:.4g} B/s counting bytes read plus written; got {measured:.4g} B/s")
