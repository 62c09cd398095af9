"""bench_speculative's CPU-time clock (steadier on a loaded shared CPU): rates from this
thread's CPU time, the same rows and greedy identity; an unknown clock is named."""
from __future__ import annotations

import pytest

from layer4_algorithms.bench.speculative import bench_speculative


def test_cpu_clock_rates():
    r = bench_speculative(ks=(2,), dynamic=(), ngram_ks=(), prompts={"a": "ROMEO.\n"},
                          copy_prompt="KING.\n", new_tokens=6, repeats=1, clock="cpu")
    (row,) = r["prompts"]["a"]["rows"]
    assert r["clock"] == "cpu" and r["prompts"]["a"]["target_tokens_per_s"] > 0
    assert row["tokens_per_s"] > 0 and row["matches_greedy"]


def test_unknown_clock_is_named():
    with pytest.raises(ValueError, match="clock"):
        bench_speculative(clock="sundial")


def test_progress_lines_and_serving_draft():
    lines: list[str] = []
    r = bench_speculative(ks=(2,), dynamic=(), ngram_ks=(3,), prompts={"a": "ROMEO.\n"},
                          copy_prompt="KING.\n", new_tokens=6, repeats=1, lean_draft=False,
                          progress=lines.append)
    assert r["lean_draft"] is False
    assert all(x["matches_greedy"] for p in r["prompts"].values() for x in p["rows"])
    # loaded, each prompt's baseline, each row (draft k=2 and ngram k=3 on "a"; ngram on copy)
    assert len(lines) == 1 + 2 + 3 and all(x.startswith("[") for x in lines)
    assert "draft k=2" in lines[2] and "ngram k=3" in lines[-1]


def test_cli_configurations_reach_the_bench(monkeypatch):
    from layer4_algorithms.bench import commands

    seen = {}

    def fake(**kw):
        seen.update(kw)
        return {"device": kw["device"], "threads": 1, "dtype": "float32", "new_tokens": 1,
                "repeats": 1, "prompts": {}, "summary": {}}
    monkeypatch.setattr(commands, "bench_speculative", fake)
    monkeypatch.setattr(commands, "_print", lambda rows, info, name: None)
    commands.bench(["--only", "spec", "--spec-devices", "cpu", "--spec-ks", "3,6",
                    "--spec-dynamic", "", "--spec-ngram-ks", "4", "--spec-hybrid-ks", "",
                    "--spec-serving-draft"])
    assert (seen["ks"], seen["dynamic"], seen["ngram_ks"], seen["hybrid_ks"]) == \
        ((3, 6), (), (4,), ())
    assert seen["lean_draft"] is False and callable(seen["progress"])
