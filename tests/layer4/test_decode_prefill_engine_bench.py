"""benchmarks/decode_prefill_engine.py and decode_prefill_engine_summary.py (decode MBU,
prefill MFU and engine throughput in one GPU call) on a tiny CPU model: each part writes its
JSON with the fields the summary reads, and the summary reports a missing part as missing
instead of failing."""
from __future__ import annotations

from tests.benchmark_script import load as _load


def test_parts_write_what_the_summary_reads(tmp_path):
    bench, summary = _load("decode_prefill_engine"), _load("decode_prefill_engine_summary")
    d = bench.main(["decode", "--smoke", "--out", str(tmp_path)])
    p = bench.main(["prefill", "--smoke", "--out", str(tmp_path)])
    assert d["tokens_per_s"] > 0 and 0 < d["MBU"] and d["target_MBU"] == 0.8
    assert len(p["runs_ms"]) == 5 and p["MFU_min"] <= p["MFU"] <= p["MFU_max"]
    # the same prefill through the engine: one step a run (the prompt fits the budget)
    assert len(p["engine_runs_ms"]) == 5 and p["engine_steps"] == [1] * 5
    assert p["engine_MFU_min"] <= p["engine_MFU"] <= p["engine_MFU_max"]
    lines = summary.summary(tmp_path)
    assert any(line.startswith("decode 1B") for line in lines)
    assert any(line.startswith("prefill 2048 x5") for line in lines)
    assert any("through the engine" in line for line in lines)
    assert any("engine: MISSING" in line for line in lines)  # not run here: said, not fatal
