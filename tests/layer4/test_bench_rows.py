"""Layer 4's bench JSON carries every figure as a ratio to a reference of the same run and as
a roofline fraction: throughput, prefix, paged-kernel and speculative rows."""
from __future__ import annotations

import json

from layer4_algorithms.bench import commands
from layer4_algorithms.bench.rows import NO_CPU_CEILING, annotate
from layer4_algorithms.bench.speculative import bench_speculative

FIELDS = ("what", "device", "ratio", "ratio_reference", "roofline_fraction")


def _kernel_result() -> dict:
    return dict(batch=4, context=512, num_splits=2, auto=True, ours_us=20.0, sdpa_us=10.0,
                speedup=0.5, sdpa_backend="flash/rows", gbps=500.0, of_copy=0.17,
                max_abs_diff=1e-3, ours_graph_us=9.0, sdpa_graph_us=9.9, graph_speedup=1.1)


def test_throughput_and_prefix_rows_get_ratios():
    rows = [{"what": "ours, continuous", "device": "cuda", "tokens_per_s": 300.0,
             "roofline_fraction": 0.25},
            {"what": "transformers generate, padded batches of 4", "device": "cuda",
             "tokens_per_s": 100.0, "roofline_fraction": 0.02},
            {"what": "8 requests, prefix cache ON", "device": "cpu", "mean_ttft_s": 0.1},
            {"what": "8 requests, prefix cache off", "device": "cpu", "mean_ttft_s": 0.3}]
    out = annotate(rows, {})
    assert all(f in r for r in out for f in FIELDS)
    assert out[0]["ratio"] == 3.0 and out[0]["roofline_fraction"] == 0.25
    assert abs(out[2]["ratio"] - 3.0) < 1e-9 and out[2]["roofline_fraction"] is None


def test_kernel_rows_from_info():
    (row,) = annotate([], {"paged_decode_kernel": [_kernel_result()]})
    assert row["ratio"] == 0.5 and row["graph_speedup"] == 1.1 and row["roofline_fraction"] == 0.17
    assert "batch 4 x context 512" in row["what"]


def test_spec_json_has_rows_on_cpu(tmp_path, monkeypatch, capsys):
    """bench_spec.json used to be written with empty rows: now one per configuration."""
    monkeypatch.setenv("LLM_STACK_RESULTS", str(tmp_path))
    result = bench_speculative(ks=(2,), dynamic=(), ngram_ks=(2,), prompts={"a": "HAMLET.\n"},
                               new_tokens=6, repeats=1)
    commands._print([], {"speculative": {"cpu": result}}, name="bench_spec.json")
    saved = json.loads((tmp_path / "layer4" / "bench_spec.json").read_text())
    rows = saved["rows"]
    assert {r["what"] for r in rows} >= {"speculative draft k=2, prompt a",
                                          "speculative ngram k=2, prompt copy",
                                          "speculative draft k=2, geometric mean over the prompts"}
    for r in rows:
        assert all(f in r for f in FIELDS) and r["ratio"] > 0
        assert r["roofline_fraction"] is None and r["roofline_note"]
    assert all(r["matches_greedy"] for r in rows if "matches_greedy" in r)
    assert any(r.get("roofline_note") == NO_CPU_CEILING for r in rows)
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if not line.startswith("wrote ")]  # a tmp path
    assert "draft k=2" in out and max(len(line) for line in table) <= 80


def test_table_reads_at_80_columns_with_ratio_and_roofline_per_row():
    from rich.console import Console

    rows = annotate([{"what": "ours, continuous batching, max_num_seqs=256", "device": "cuda",
                      "tokens_per_s": 18000.0, "roofline_fraction": 0.28, "preemptions": 0},
                     {"what": "transformers generate, padded batches of 64", "device": "cuda",
                      "tokens_per_s": 1000.0, "roofline_fraction": 0.02},
                     {"what": "8 requests sharing a 256-token prefix (+16 own), prefix cache ON",
                      "device": "cpu", "mean_ttft_s": 0.1},
                     {"what": "8 requests sharing a 256-token prefix (+16 own), prefix cache off",
                      "device": "cpu", "mean_ttft_s": 0.3}],
                    {"paged_decode_kernel": [_kernel_result()]})
    assert rows[3]["ratio"] == 1.0  # the prefix-off row is its ON row's reference
    console = Console(width=80, record=True)
    console.print(commands.bench_table(rows))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    for figure in ("18.00x", "28%", "3.00x", "1.00x", "0.50x", "17%", "TTFT 100.0 ms", "-*"):
        assert figure in text, figure
