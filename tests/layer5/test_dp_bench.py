"""The data-parallel benchmark on a CPU (course model, two replicas): every layout's rows, what
each replica did (sequences, tokens, steps, host time a step), DP's tokens equal one engine's,
and one engine running DP's replica-0 hand gives that replica's tokens."""
from __future__ import annotations

import pytest

from layer5_parallel.bench.dp import bench_dp, differences, format_dp


def test_differences_names_the_first_differing_position():
    assert differences([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]]) == {
        "same_tokens": True, "seqs_differ": 0, "first_difference": None,
        "median_first_difference": None}
    d = differences([[1, 2, 3], [4, 5, 6], [7]], [[1, 9, 3], [4, 5, 0], [7]])
    assert (d["same_tokens"], d["seqs_differ"], d["first_difference"],
            d["median_first_difference"]) == (False, 2, 1, 1.5)
    assert differences([[1, 2]], [[1]])["first_difference"] == 1  # a shorter output


def test_bench_dp_on_cpu_reports_each_replica():
    r = bench_dp(2, num_seqs=6, max_in=12, max_out=5, layouts=("1", "dp", "hand"))
    one, dp, hand = r["rows"]
    assert not r["failed"]
    assert dp["same_tokens"] and dp["vs_1"] > 0
    assert hand["same_as_dp_replica_0"] is True
    assert [rep["replica"] for rep in dp["replicas"]] == [0, 1]
    assert sum(rep["sequences"] for rep in dp["replicas"]) == 6
    assert sum(rep["output_tokens"] for rep in dp["replicas"]) == dp["output_tokens"] == 30
    for rep in dp["replicas"] + one["replicas"]:
        assert rep["steps"] >= 5 and rep["wall_s"] > 0 and rep["host_ms_per_step"] >= 0
    assert hand["replicas"][0]["sequences"] == dp["replicas"][0]["sequences"]
    text = format_dp(r)
    assert "replica 1 (cpu)" in text and "same tokens as DP's replica 0: True" in text
    with pytest.raises(ValueError, match="unknown layout"):
        bench_dp(2, layouts=("1", "nope"))
