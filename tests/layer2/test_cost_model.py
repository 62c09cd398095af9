"""The alpha-beta cost model is pure arithmetic: check it against the formulas by hand."""
from __future__ import annotations

import numpy as np
import pytest

from layer2_comm.cost_model import (
    ALGORITHMS,
    LINKS,
    AlphaBeta,
    busbw,
    collective_of,
    crossover,
    fit_alpha_beta,
    predict,
)

AB = AlphaBeta(alpha_s=5e-6, beta_s_per_byte=1 / 50e9)  # 5 us, 50 GB/s
A, B = AB.alpha_s, AB.beta_s_per_byte
M = 1 << 20


@pytest.mark.parametrize(("algorithm", "world", "expected"), [
    ("ring_all_reduce", 4, 6 * A + 1.5 * M * B),
    ("ring_all_reduce", 3, 4 * A + 4 / 3 * M * B),
    ("tree_all_reduce", 4, 2 * (A + M * B)),
    ("tree_all_reduce", 8, 3 * (A + M * B)),
    ("tree_all_reduce", 3, 3 * (A + M * B)),   # 1 doubling step + fold in + fold out
    ("tree_all_reduce", 6, 4 * (A + M * B)),
    ("ring_all_gather", 4, 3 * (A + M / 4 * B)),
    ("ring_reduce_scatter", 2, 1 * (A + M / 2 * B)),
    ("all_to_all", 4, 3 * (A + M / 4 * B)),
    ("broadcast_tree", 5, 3 * (A + M * B)),
    ("broadcast_chain", 4, (3 + 3) * (A + M / 4 * B)),
])
def test_predictions_match_the_hand_formulas(algorithm, world, expected):
    assert predict(algorithm, M, world, AB) == pytest.approx(expected, rel=1e-12)


def test_chain_pipelining_depth_and_hierarchical():
    assert predict("broadcast_chain", M, 4, AB, chunks=1) == pytest.approx(3 * (A + M * B))
    inter = AlphaBeta(10e-6, 1 / 25e9)
    expected = 2 * 1 * (A + M * B) + (2 * 3 * inter.alpha_s + 2 * 3 / 4 * M * inter.beta_s_per_byte)
    got = predict("hierarchical_all_reduce", M, 8, AB, ranks_per_node=2, inter=inter)
    assert got == pytest.approx(expected)
    with pytest.raises(ValueError, match="ranks_per_node"):
        predict("hierarchical_all_reduce", M, 8, AB, ranks_per_node=3)


def test_one_rank_costs_nothing_and_bad_input_is_named():
    assert all(predict(alg, M, 1, AB, ranks_per_node=1) == 0 for alg in ALGORITHMS)
    with pytest.raises(ValueError, match="unknown algorithm 'ring'"):
        predict("ring", M, 4, AB)
    with pytest.raises(ValueError, match="world"):
        predict("ring_all_reduce", M, 0, AB)
    with pytest.raises(ValueError, match=">= 0"):
        AlphaBeta(-1.0, 0.0)


def test_time_grows_with_size_and_datasheet_links():
    for alg in ALGORITHMS:
        t = [predict(alg, n, 4, AB, ranks_per_node=2) for n in (0, 1 << 10, 1 << 20)]
        assert t[0] < t[1] < t[2]
    nvlink = LINKS["nvlink4 (H100/H200 SXM, 450 GB/s)"]
    assert nvlink.bandwidth == pytest.approx(450e9)
    assert nvlink.message(450e6) == pytest.approx(3e-6 + 1e-3)


def test_crossover_is_where_ring_overtakes_tree():
    x = crossover("ring_all_reduce", "tree_all_reduce", 4, AB)
    assert x == pytest.approx(8 * A / B)  # 6a + 1.5mb = 2a + 2mb
    assert predict("tree_all_reduce", x / 2, 4, AB) < predict("ring_all_reduce", x / 2, 4, AB)
    assert predict("ring_all_reduce", x * 2, 4, AB) < predict("tree_all_reduce", x * 2, 4, AB)
    assert crossover("tree_all_reduce", "ring_all_reduce", 4, AB) == pytest.approx(x)
    for world in (3, 5, 8, 16):
        x = crossover("ring_all_reduce", "tree_all_reduce", world, AB)
        assert x is not None and x > 0
        assert predict("ring_all_reduce", 1.01 * x, world, AB) < predict("tree_all_reduce", 1.01 * x, world, AB)


def test_no_crossover_when_lines_do_not_cross():
    # on 2 ranks both send the whole message once; tree has fewer steps at every size
    assert crossover("ring_all_reduce", "tree_all_reduce", 2, AB) is None
    assert crossover("ring_all_reduce", "ring_all_reduce", 4, AB) is None
    # all-gather is below all-reduce everywhere (fewer steps and fewer bytes)
    assert crossover("ring_all_gather", "ring_all_reduce", 4, AB) is None


def test_fit_recovers_alpha_and_beta_through_noise():
    rng = np.random.default_rng(0)
    sizes = np.array([2 ** k for k in range(3, 27)], dtype=float)
    truth = AlphaBeta(20e-6, 1 / 8e9)
    times = np.array([truth.message(n) for n in sizes]) * rng.lognormal(0.0, 0.05, sizes.size)
    fit = fit_alpha_beta(sizes, times)
    assert fit.alpha_s == pytest.approx(truth.alpha_s, rel=0.1)
    assert fit.beta_s_per_byte == pytest.approx(truth.beta_s_per_byte, rel=0.1)
    plain = fit_alpha_beta(sizes, times, relative=False)
    assert plain.beta_s_per_byte == pytest.approx(truth.beta_s_per_byte, rel=0.1)


def test_fit_clamps_unphysical_coefficients_and_rejects_bad_input():
    flat = fit_alpha_beta([8, 64, 512], [1e-5, 0.9e-5, 0.8e-5])  # shrinks with size: noise
    assert flat.beta_s_per_byte == 0 and flat.alpha_s == pytest.approx(0.9e-5, rel=0.1)
    origin = fit_alpha_beta([1e3, 1e6], [1e-7, 1e-3])  # would need a negative alpha
    assert origin.alpha_s == 0 and origin.beta_s_per_byte > 0
    with pytest.raises(ValueError, match="two distinct"):
        fit_alpha_beta([8, 8], [1e-5, 1e-5])
    with pytest.raises(ValueError, match="equally long"):
        fit_alpha_beta([8, 16], [1e-5])


@pytest.mark.parametrize(("collective", "world", "factor"), [
    ("all_reduce", 4, 1.5), ("ring_all_reduce", 2, 1.0), ("tree_all_reduce", 8, 1.75),
    ("all_gather", 4, 0.75), ("reduce_scatter", 2, 0.5), ("broadcast", 8, 1.0),
    ("broadcast_chain", 3, 1.0), ("all_to_all", 4, 0.75),
])
def test_busbw_uses_the_nccl_tests_factors(collective, world, factor):
    assert busbw(100e9, collective, world) == pytest.approx(100e9 * factor)


def test_busbw_names_unknown_collectives():
    assert collective_of("hierarchical_all_reduce") == "all_reduce"
    with pytest.raises(ValueError, match="unknown collective 'gossip'"):
        busbw(1.0, "gossip", 4)
