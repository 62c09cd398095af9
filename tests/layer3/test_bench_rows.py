"""Layer 3's bench rows: prefill measured five times with median and spread, and
every row with a ratio to a reference of the same run and a roofline fraction."""
from __future__ import annotations

import torch

from layer3_model import bench_rows as R
from layer3_model.config import ModelConfig
from layer3_model.weights import random_model

TINY = dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
            max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0)


def test_prefill_row_has_median_and_spread_of_five_runs():
    net = random_model(ModelConfig.from_dict(TINY), dtype=torch.float32, device="cpu")
    row = R.prefill_row(net, 16, "torch", peak_flops=1e12)
    assert len(row["runs_ms"]) == 5
    assert row["MFU_min"] <= row["MFU"] <= row["MFU_max"]
    assert min(row["runs_ms"]) <= row["ms"] <= max(row["runs_ms"])


def test_annotate_gives_every_row_a_ratio_and_roofline():
    rows = [{"what": "course target, batch-1 decode, CPU (1 threads), fp32", "tokens_per_s": 200.0},
            {"what": "course draft, batch-1 decode, CPU (1 threads), fp32", "tokens_per_s": 600.0},
            {"what": "1B decode bs1, triton backend, CUDA graph", "tokens_per_s": 600.0,
             "bytes_per_token": 2.5e9, "MBU": 0.5},
            {"what": "1B decode bs1, W8A16 (int8 weights, lm_head too), triton, CUDA graph",
             "tokens_per_s": 660.0, "MBU": 0.3},
            {"what": "1B prefill 2048 tokens, torch backend", "tokens_per_s": 4e4, "MFU": 0.1},
            {"what": "1B prefill 2048 tokens, triton backend", "tokens_per_s": 2e5, "MFU": 0.5,
             "MFU_min": 0.45, "MFU_max": 0.6, "runs_ms": [1.0] * 5},
            {"what": "transformers generate bs1, static cache, auto-compiled",
             "tokens_per_s": 300.0}]
    R.annotate(rows, {"copy_bandwidth": 3e12})
    for r in rows:
        assert {"ratio", "ratio_reference", "roofline_fraction"} <= r.keys()
    assert rows[1]["ratio"] == 3.0 and rows[0]["ratio"] == 1.0  # draft over target
    assert rows[0]["is_reference"] and not rows[1]["is_reference"]
    assert rows[1]["roofline_fraction"] is None and rows[1]["roofline_note"] == R.NO_CPU_CEILING
    assert rows[2]["ratio"] == 2.0 and rows[2]["roofline_fraction"] == 0.5  # vs transformers
    assert abs(rows[3]["ratio"] - 1.1) < 1e-9  # W8A16 over bf16
    assert rows[5]["ratio"] == 5.0 and rows[5]["roofline_fraction"] == 0.5  # triton over torch
    assert rows[6]["ratio"] == 1.0 and abs(rows[6]["roofline_fraction"] - 0.25) < 1e-9
    assert "5 runs" in _render(rows)


def test_table_reads_at_80_columns_with_a_ratio_and_roofline_per_row():
    rows = [{"what": "course target, batch-1 decode, CPU (1 threads), fp32", "tokens_per_s": 200.0},
            {"what": "course draft, batch-1 decode, CPU (1 threads), fp32", "tokens_per_s": 600.0},
            {"what": "1B prefill 2048 tokens, torch backend", "tokens_per_s": 4e4, "MFU": 0.1,
             "ms": 53.0},
            {"what": "1B prefill 2048 tokens, triton backend", "tokens_per_s": 2e5, "MFU": 0.62,
             "ms": 8.7, "MFU_min": 0.58, "MFU_max": 0.65, "runs_ms": [8.7] * 5,
             "graph_MFU": 0.67, "host_bound": True}]
    text = _render(R.annotate(rows, {}), width=80)
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "3.00x" in text and "5.00x" in text and text.count("ref") >= 2
    assert "GPU-only 67%" in text and "* " + R.NO_CPU_CEILING[:20] in text.replace("\n", " ")


def _render(rows: list[dict], width: int = 200) -> str:
    from rich.console import Console

    console = Console(width=width, record=True)
    console.print(R.table(rows))
    return console.export_text()
