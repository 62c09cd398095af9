"""`stack run --layer 4` end to end on the course model, and the benchmark's pieces on the tiny
model (a fast stand-in for the full `stack bench --layer 4`)."""
from __future__ import annotations

import json
from importlib.metadata import entry_points

import pytest

from layer4_algorithms import LLM
from layer4_algorithms.bench import commands
from layer4_algorithms.bench import engine as B

from .l4_helpers import assert_no_leak


def test_run_serves_the_course_model_and_reports(capsys):
    assert commands.run(["--max-num-seqs", "3"]) == 0
    text = capsys.readouterr().out
    assert "tokens generated" in text and "prefix cache:" in text and "preemptions:" in text
    assert "HORATIO." in text and "(2/2)" in text  # n=2 shows both completions


def test_entry_point_is_registered():
    eps = {ep.name: ep.value for ep in entry_points(group="llm_stack.layers")}
    assert eps.get("4") == "layer4_algorithms.bench.commands" and commands.TITLE


def test_bench_pieces_on_a_tiny_workload(tiny_model):
    wl = B.random_workload(6, 3, 12, tiny_model.config.vocab_size, seed=1)
    assert len(wl.prompts) == 6 and all(3 <= len(p) <= 12 for p in wl.prompts)
    assert all(3 <= n <= 12 for n in wl.out_lens)
    llm = LLM(tiny_model, block_size=4, num_blocks=64, max_num_seqs=2, scheduling="static")
    r = B.time_engine(llm, wl)
    assert r["tokens_per_s"] > 0 and r["steps"] > max(wl.out_lens)
    assert_no_leak(llm)
    assert B.time_layer3(tiny_model, wl, 2)["tokens_per_s"] > 0
    on = B.prefix_ttft(tiny_model, prefix_len=16, suffix_len=3, num_seqs=3, max_tokens=2,
                       enable_prefix_caching=True,
                       block_size=4, num_blocks=64)
    off = B.prefix_ttft(tiny_model, prefix_len=16, suffix_len=3, num_seqs=3, max_tokens=2,
                        enable_prefix_caching=False, block_size=4, num_blocks=64)
    assert on["prefix_hit_rate"] == pytest.approx(16 / 19) and off["prefix_hit_rate"] == 0
    assert on["outputs"] == off["outputs"]
    floor = B.roofline_floor_s(tiny_model.net, wl, 2, bandwidth=1e9, flops=1e12)
    assert 0 < floor < r["seconds"] * 1e3


def test_bench_table_and_json(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LLM_STACK_RESULTS", str(tmp_path))
    rows = [{"what": "ours, continuous", "device": "cpu", "tokens_per_s": 200.0, "seconds": 1.0,
             "steps": 3},
            {"what": "transformers generate, padded batches of 4", "device": "cpu",
             "tokens_per_s": 100.0,
             "seconds": 2.0}]
    commands._print(rows, {"gpu": "none"})
    assert "2.00x" in capsys.readouterr().out
    saved = json.loads((tmp_path / "layer4" / "bench.json").read_text())
    assert saved["rows"][0]["tokens_per_s"] == 200.0
