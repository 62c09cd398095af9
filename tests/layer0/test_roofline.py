"""Roofline math and cost models against hand-computed values."""
from __future__ import annotations

import math

import pytest

import layer0_hardware as hw

H100_BF16, H100_BW = 989.4e12, 3.35e12


def test_arithmetic_intensity_values_and_errors():
    assert hw.arithmetic_intensity(10.0, 4.0) == 2.5
    assert hw.arithmetic_intensity(0.0, 8.0) == 0.0  # a pure copy does no math
    for flops, nbytes in ((1.0, 0.0), (1.0, -3.0), (-1.0, 2.0)):
        with pytest.raises(ValueError):
            hw.arithmetic_intensity(flops, nbytes)


def test_ridge_point_h100():
    # 989.4 TFLOP/s / 3.35 TB/s = 295.3 FLOP/byte: below it an H100 waits on HBM.
    assert math.isclose(hw.ridge_point(H100_BF16, H100_BW), 295.343, rel_tol=1e-5)
    with pytest.raises(ValueError):
        hw.ridge_point(0.0, H100_BW)
    with pytest.raises(ValueError):
        hw.ridge_point(H100_BF16, -1.0)


def test_attainable_flops_on_slope_roof_and_ridge():
    assert hw.attainable_flops(1.0, 100.0, 10.0) == 10.0  # slope: 1 FLOP/B * 10 B/s
    assert hw.attainable_flops(50.0, 100.0, 10.0) == 100.0  # flat roof
    assert hw.attainable_flops(10.0, 100.0, 10.0) == 100.0  # exactly the ridge
    assert hw.attainable_flops(0.0, 100.0, 10.0) == 0.0
    with pytest.raises(ValueError):
        hw.attainable_flops(-1.0, 100.0, 10.0)
    with pytest.raises(ValueError):
        hw.attainable_flops(1.0, 100.0, 0.0)


def test_classify_bound_including_the_ridge():
    assert hw.classify_bound(9.99, 100.0, 10.0) == "memory"
    assert hw.classify_bound(10.0, 100.0, 10.0) == "compute"  # at the ridge: compute
    assert hw.classify_bound(10.01, 100.0, 10.0) == "compute"
    assert hw.classify_bound(0.083, H100_BF16, H100_BW) == "memory"
    with pytest.raises(ValueError):
        hw.classify_bound(-0.5, 100.0, 10.0)


def test_vector_add_cost():
    assert hw.vector_add_cost(1000) == (1000.0, 12000.0)  # fp32: 3 * 1000 * 4 bytes
    assert hw.vector_add_cost(10, dtype_bytes=2) == (10.0, 60.0)
    for bad in (0, -5, 2.5):
        with pytest.raises(ValueError):
            hw.vector_add_cost(bad)


def test_matmul_cost():
    flops, nbytes = hw.matmul_cost(2, 3, 4, dtype_bytes=2)
    assert flops == 2 * 2 * 3 * 4 == 48
    assert nbytes == (2 * 4 + 4 * 3 + 2 * 3) * 2 == 52
    f, b = hw.matmul_cost(8192, 8192, 8192)  # square bf16: intensity n/3
    assert math.isclose(f / b, 8192 / 3)
    with pytest.raises(ValueError):
        hw.matmul_cost(0, 3, 4)


def test_attention_decode_cost_llama_8b_shape():
    # Llama-3-8B: 32 query heads, 8 KV heads, head_dim 128; batch 1 at 4096 tokens, bf16.
    flops, nbytes = hw.attention_decode_cost(1, 32, 8, 128, 4096)
    assert flops == 4 * 32 * 4096 * 128 == 67_108_864
    assert nbytes == 2 * 8 * 4096 * 128 * 2 + 2 * 32 * 128 * 2 == 16_793_600
    assert hw.classify_bound(flops / nbytes, H100_BF16, H100_BW) == "memory"


def test_attention_decode_cost_errors():
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        hw.attention_decode_cost(1, 6, 4, 64, 10)
    with pytest.raises(ValueError, match="context_len"):
        hw.attention_decode_cost(1, 8, 8, 64, 0)


def test_roofline_point_properties():
    p = hw.RooflinePoint("op", flops=100.0, nbytes=50.0, seconds=2.0)
    assert (p.intensity, p.achieved_flops, p.achieved_bandwidth) == (2.0, 50.0, 25.0)
    with pytest.raises(ValueError):
        hw.RooflinePoint("bad", flops=1.0, nbytes=1.0, seconds=0.0)
