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


class _At:
    """A stand-in CUDA event: the GPU reached it at `t` ms."""

    def __init__(self, t: float) -> None:
        self.t = t

    def elapsed_time(self, later: _At) -> float:
        return later.t - self.t


def _row(begin, end, prefill=0, decodes=0, step=0):
    return {"begin": None if begin is None else _At(begin), "end": None if end is None
            else _At(end), "host_launch_s": 0.001, "step_index": step, "seqs": decodes + 1,
            "prefill_tokens": prefill, "prefill_attended": prefill * prefill / 2,
            "decodes": decodes, "decode_context": 100 * decodes}


def test_timeline_groups_spans_gaps_and_the_step_after_a_prefill():
    pe = _load()
    import layer3_model as l3
    net = l3.random_model(l3.ModelConfig(model_type="llama", vocab_size=64, hidden_size=32,
                                         intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1,
                                         head_dim=16, max_position_embeddings=64))
    rows = [_row(0, 10, prefill=50, step=0), _row(12, 13, decodes=3, step=1),
            _row(13, 14, decodes=40, step=2), _row(14.5, 16, decodes=200, step=3),
            _row(16, 17, prefill=5, decodes=2, step=4)]
    g = pe.timeline_groups(rows, net, 1e9, 1e9, [1.0, 2.0, 3.0, 4.0, 5.0])
    assert list(g) == ["prefill", "first decode", "decode B<=128", "decode B>128"]
    assert g["prefill"]["steps"] == 2 and g["prefill"]["span_ms"] == 11
    assert g["prefill"]["gap_ms"] == 0 and g["prefill"]["tokens"] == 57
    assert g["first decode"]["gap_ms"] == 2 and g["first decode"]["span_ms"] == 1
    assert g["decode B>128"]["gap_ms"] == 0.5 and g["decode B>128"]["host_step_ms"] == 4.0
    assert all(v["floor_ms"] > 0 for v in g.values())
    # on a CPU (no events) the spans and gaps are 0, the rest is counted
    cpu = pe.timeline_groups([_row(None, None, decodes=2)], net, 1e9, 1e9, [1.0])
    assert cpu["decode B<=32"]["span_ms"] == 0 and cpu["decode B<=32"]["steps"] == 1


def test_timeline_smoke_runs_the_whole_workload(tmp_path):
    pe = _load()
    out = tmp_path / "tl.json"
    result = pe.main(["--smoke", "--timeline", "--json", str(out)])
    saved = json.loads(out.read_text())
    assert saved["launches"] == len(saved["per_step"]) == result["launches"] > 0
    assert sum(g["steps"] for g in saved["groups"].values()) == saved["launches"]
    assert saved["groups"]["prefill"]["tokens"] > 0
    # every launch of the workload is a step's; outputs all produced (generate checked them)
    assert sum(g["tokens"] for g in saved["groups"].values()) >= saved["launches"]
