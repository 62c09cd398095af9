"""benchmarks/prefill_attention_sweep.py on the CPU (--cpu-smoke): every flash variant (both
grid orders) is checked against the reference and timed, the CUDA-only variants are listed
with the reason they did not run, and the verdict names the default and the best variant."""
from __future__ import annotations

import pytest

from tests.benchmark_script import load


@pytest.mark.interpreter  # the flash variants run through Triton's interpreter
def test_cpu_smoke_checks_every_variant(tmp_path, capsys):
    sweep = load("prefill_attention_sweep")
    result = sweep.main(["--cpu-smoke", "--out", str(tmp_path)])
    rows = result["rows"]
    flash = [r for r in rows if r["kind"] == "flash"]
    assert {r["config"]["HEADS_FIRST"] for r in flash} == {False, True}
    assert all(r["ok"] and r["rel_err"] < 1e-5 and r["us"] > 0 for r in flash)
    assert sum(r["name"].endswith("(default)") for r in flash) == 1
    others = [r for r in rows if r["kind"] != "flash"]
    assert {r["kind"] for r in others} == {"cudnn", "sdpa_cudnn", "sdpa_flash"}
    assert all("needs CUDA" in r["error"] for r in others)
    (v,) = result["verdicts"]
    assert v["best_flash_us"] <= v["default_us"] and "cudnn_us" not in v
    assert (tmp_path / "prefill_attention_sweep.json").is_file()
    assert "VERDICT T=37 D=16" in capsys.readouterr().out
