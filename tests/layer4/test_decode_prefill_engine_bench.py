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


def test_summary_reports_the_graph_and_first_decode_rows(tmp_path):
    """A GPU run's prefill.json adds the engine with prefill graphs and the first-decode pair:
    the summary prints both (the CPU smoke run has neither)."""
    import json  # noqa: PLC0415

    bench, summary = _load("decode_prefill_engine"), _load("decode_prefill_engine_summary")
    p = bench.main(["prefill", "--smoke", "--out", str(tmp_path)])
    assert "graph_engine_ms" not in p and "first_decode_ms" not in p
    p.update(graph_engine_ms=7.9, graph_engine_runs_ms=[7.9] * 5, graph_engine_MFU=0.7,
             graph_engine_MFU_min=0.69, graph_engine_MFU_max=0.71, graph_tokens_equal=True,
             graph_engine_prefill_graph_pool_MiB=150.0,
             first_decode_ms={"overlapped": 9.0, "read_first": 9.6}, first_decode_saved_ms=0.6,
             first_decode_tokens_equal=True)
    (tmp_path / "prefill.json").write_text(json.dumps(p))
    lines = summary.summary(tmp_path)
    assert any("prefill graphs (tokens equal: True, pool 150 MiB)" in x and "70%" in x
               for x in lines)
    assert any("first decode" in x and "9.00 / 9.60" in x and "saved 0.60 ms" in x
               for x in lines)

