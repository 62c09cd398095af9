"""bench_speculative's CPU-time clock (steadier on a loaded shared CPU): rates from this
thread's CPU time, the same rows and greedy identity; an unknown clock is named."""
from __future__ import annotations

import pytest

from layer4_algorithms.spec import bench_speculative


def test_cpu_clock_rates():
    r = bench_speculative(ks=(2,), dynamic=(), ngram_ks=(), prompts={"a": "ROMEO.\n"},
                          copy_prompt="KING.\n", new_tokens=6, repeats=1, clock="cpu")
    (row,) = r["prompts"]["a"]["rows"]
    assert r["clock"] == "cpu" and r["prompts"]["a"]["target_tokens_per_s"] > 0
    assert row["tokens_per_s"] > 0 and row["matches_greedy"]


def test_unknown_clock_is_named():
    with pytest.raises(ValueError, match="clock"):
        bench_speculative(clock="sundial")
