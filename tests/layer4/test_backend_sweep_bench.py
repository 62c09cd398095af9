"""benchmarks/backend_sweep.py (triton vs torch backend decode, one GPU call) on a tiny CPU
model: every planned row is measured and written, the variants agree on the logits, and the
fused-path limit is read off the fused-vs-general rows as documented."""
from __future__ import annotations

import json

import pytest

from tests.benchmark_script import load


def _load():
    return load("backend_sweep")


def test_smoke_run_writes_every_row(tmp_path):
    bench = _load()
    r = bench.main(["--shape", "8b", "--smoke", "--out", str(tmp_path), "--batches", "1,3",
                    "--general-batches", "2", "--engine-batches", "2",
                    "--extra", "triton-nopdl:3"])
    got = {(row["part"], row["variant"], row["batch"]) for row in r["rows"]}
    assert got == {("step", v, b) for v in ("torch", "triton") for b in (1, 3)} | {
        ("step", "triton-fused", 2), ("step", "triton-general", 2), ("step", "triton-nopdl", 3),
        ("engine", "torch", 2), ("engine", "triton", 2)}
    assert all(row["tokens_per_s"] > 0 for row in r["rows"])
    for row in r["rows"]:
        if row["part"] == "step":  # every variant computes the torch backend's logits
            assert row["argmax_agree"] == 1.0 and row["max_abs_logit_diff"] < 1e-3
    assert json.loads((tmp_path / "backend_sweep_8b.json").read_text())["rows"] == r["rows"]
    assert any("triton / torch" in line for line in bench.table(r))


def test_fused_limit_is_the_last_batch_before_the_fused_step_gets_slower():
    bench = _load()

    def rows(pairs):
        return {"rows": [{"part": "step", "variant": v, "batch": b, "step_ms": ms}
                         for b, (fused, general) in pairs.items()
                         for v, ms in (("triton-fused", fused), ("triton-general", general))]}
    assert bench.fused_limit(rows({1: (1.0, 1.3), 2: (1.0, 1.1), 4: (1.2, 1.1),
                                   8: (1.0, 2.0)})) == 2  # 8 is faster again: not counted
    assert bench.fused_limit(rows({1: (1.0, 0.9)})) is None
    assert bench.fused_limit(rows({1: (1.0, 1.2), 2: (1.005, 1.0)})) == 2  # within 1 %


def test_table_from_a_missing_or_empty_file_says_so(tmp_path, capsys):
    bench = _load()
    empty = tmp_path / "empty.json"
    empty.write_text("")
    for path in (tmp_path / "missing.json", empty):
        with pytest.raises(SystemExit) as exit_:
            bench.main(["--table-from", str(path)])
        assert exit_.value.code == 2
        assert f"--table-from {path}: not a backend_sweep JSON" in capsys.readouterr().err


def test_no_step_rows_is_a_usage_error(capsys):
    bench = _load()
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--smoke", "--batches", "", "--general-batches", "", "--extra", ""])
    assert exit_.value.code == 2 and "no step rows to measure" in capsys.readouterr().err
