"""Lab 0 grader: the roofline model and measuring a device properly.

Graded through the `impl` fixture (tests/labs/conftest.py): the layer0_hardware package
under plain pytest, a student's exercises.py under `stack grade --lab 0`.
"""
from __future__ import annotations

import math
import random
import time

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
        batch, heads, d, ctx = rng.randint(1, 64), kv * rng.choice([1, 2, 4]), rng.choice([64, 128]), rng.randint(1, 32768)
        b = rng.choice([1, 2, 4])
        flops, nbytes = impl.attention_decode_cost(batch, heads, kv, d, ctx, b)
        assert _close(flops, 4 * batch * heads * ctx * d)
        assert _close(nbytes, (2 * batch * kv * ctx * d + 2 * batch * heads * d) * b)
    # Decode attention is memory-bound on every GPU: about one FLOP per byte with MHA.
    flops, nbytes = impl.attention_decode_cost(8, 32, 32, 128, 4096, 2)
    assert 0.9 < flops / nbytes < 1.1


@pytest.mark.points(15)
def test_median_time_warms_up_and_ignores_outliers(impl):
    calls = []
    slow_calls = {0, 1, 6}  # the warm-up calls and one outlier are slow

    def fn():
        time.sleep(0.05 if len(calls) in slow_calls else 0.002)
        calls.append(1)

    seconds = impl.median_time(fn, warmup=2, repeats=9)
    assert len(calls) == 11, "warm-up calls plus timed calls"
    assert 0.0015 < seconds < 0.02, f"median of mostly-2 ms calls should be about 2 ms, got {seconds}"


@pytest.mark.points(20)
def test_copy_bandwidth_is_measured(impl):
    # Loose bounds: a busy CPU is noisy. The notebook checks the factor of two by hand.
    nbytes = 32 * 2**20
    measured = impl.copy_bandwidth("cpu", nbytes)
    assert math.isfinite(measured) and measured > 0

    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    times = []
    for _ in range(15):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    ours = 2 * nbytes / sorted(times)[len(times) // 2]
    assert 0.33 < measured / ours < 3.0, f"{measured:.3g} B/s vs {ours:.3g} B/s measured here"
