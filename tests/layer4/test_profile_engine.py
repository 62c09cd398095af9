"""benchmarks/profile_engine.py: the GPU-idle arithmetic, and the script's
own code on a tiny CPU model (per-step rows, graph coverage, JSON), so the GPU run finds no
typo."""
from __future__ import annotations

import json

import pytest

from tests.benchmark_script import load


def _load():
    return load("profile_engine")


def test_union_within_clips_and_merges():
    pe = _load()
    assert pe.union_within([(0, 4), (2, 6), (8, 9), (20, 30)], 1, 10) == 5 + 1
    assert pe.union_within([], 0, 10) == 0


@pytest.mark.parametrize("mode", ["off", "on"])
def test_smoke_writes_steps_and_coverage(tmp_path, mode):
    pe = _load()
    out = tmp_path / "pe.json"
    result = pe.main(["--smoke", "--seqs", "3", "--min-len", "4", "--max-len", "12",
                      "--steps", "1", "--profile-steps", "2", "--json", str(out),
                      "--async-scheduling", mode])
    saved = json.loads(out.read_text())
    assert saved["seqs"] == 3 and len(saved["steps"]) == 2
    assert saved["async_scheduling"] is (mode == "on")
    assert saved["window"]["gpu_idle_fraction"] is None  # no GPU
    assert all(s["wall_ms"] > 0 and s["gpu_idle_fraction"] is None for s in saved["steps"])
    # on the CPU every decode pass is eager; run to the end, each sequence's last token counted
    assert saved["eager_decode_passes"] == saved["decode_passes"] > 0
    assert result["graph_coverage"].keys() == {int(b) for b in saved["graph_coverage"]}
